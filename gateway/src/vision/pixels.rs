//! Encoded image bytes to the tower's input: decode (PNG, JPEG, WebP) with
//! a pixel-count limit checked before decoding, convert to RGB (alpha is
//! dropped, as PIL's `convert("RGB")` does), resize as the model's processor
//! does (Gemma 3: bilinear to a fixed size; Gemma 4: bicubic, keeping the
//! aspect ratio, to fit its patch budget), rescale and normalise per channel
//! (rescale in float64 for Gemma 3, float32 for Gemma 4, as their
//! processors do; normalise in float32).

use std::io::Cursor;

use image::imageops::FilterType;
use image::{ImageFormat, ImageReader, RgbImage};
use runtime::vision::{Preprocess, Resize};

use super::ImageError;

/// The `(width, height)` in the image's header, refusing anything but PNG,
/// JPEG and WebP and images of more than `max_pixels` pixels.
pub fn dimensions(bytes: &[u8], max_pixels: u64) -> Result<(u32, u32), ImageError> {
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Invalid(format!("cannot read the image: {e}")))?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP) => {}
        Some(other) => {
            return Err(ImageError::Invalid(format!(
                "images in {other:?} format are not supported (send PNG, JPEG or WebP)"
            )))
        }
        None => {
            return Err(ImageError::Invalid(
                "the data is not an image (expected PNG, JPEG or WebP)".into(),
            ))
        }
    }
    let (w, h) = reader
        .into_dimensions()
        .map_err(|e| ImageError::Invalid(format!("the image is not readable: {e}")))?;
    if w as u64 * h as u64 > max_pixels {
        return Err(ImageError::TooLarge(format!(
            "the image is {w}x{h} pixels, more than the limit of {max_pixels}"
        )));
    }
    Ok((w, h))
}

/// Decodes `bytes` into RGB, with [`dimensions`]' checks first.
pub fn decode(bytes: &[u8], max_pixels: u64) -> Result<RgbImage, ImageError> {
    let (w, h) = dimensions(bytes, max_pixels)?;
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Invalid(format!("cannot read the image: {e}")))?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(w);
    limits.max_image_height = Some(h);
    reader.limits(limits);
    let decoded = reader
        .decode()
        .map_err(|e| ImageError::Invalid(format!("the image is corrupt or truncated: {e}")))?;
    Ok(decoded.to_rgb8())
}

/// A preprocessed image: `[height, width, 3]` float32 pixels, row-major,
/// ready for the tower.
pub struct Pixels {
    pub data: Vec<f32>,
    pub width: u32,
    pub height: u32,
}

pub fn preprocess(image: &RgbImage, p: &Preprocess) -> Result<Pixels, ImageError> {
    let (w, h) = image.dimensions();
    let (width, height) = p.resize.target(w, h).map_err(ImageError::Invalid)?;
    let filter = match p.resize {
        Resize::Fixed { .. } => FilterType::Triangle,
        Resize::FitPatches { .. } => FilterType::CatmullRom,
    };
    let resized;
    let image = if (w, h) == (width, height) {
        image
    } else {
        resized = image::imageops::resize(image, width, height, filter);
        &resized
    };
    let mut out = Vec::with_capacity((width * height * 3) as usize);
    for pixel in image.pixels() {
        for (c, &v) in pixel.0.iter().enumerate() {
            let mut x = v as f32;
            if p.do_rescale {
                x = if p.rescale_in_f32 {
                    v as f32 * p.rescale_factor as f32
                } else {
                    (v as f64 * p.rescale_factor) as f32
                };
            }
            if p.do_normalize {
                x = (x - p.mean[c]) / p.std[c];
            }
            out.push(x);
        }
    }
    Ok(Pixels {
        data: out,
        width,
        height,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(w: u32, h: u32, format: ImageFormat) -> Vec<u8> {
        let img = RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 128]));
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, format).unwrap();
        out.into_inner()
    }

    fn png(w: u32, h: u32) -> Vec<u8> {
        encoded(w, h, ImageFormat::Png)
    }

    #[test]
    fn reads_png_jpeg_and_webp_only() {
        for format in [ImageFormat::Png, ImageFormat::Jpeg, ImageFormat::WebP] {
            let img = decode(&encoded(6, 5, format), 100).unwrap();
            assert_eq!(img.dimensions(), (6, 5), "{format:?}");
        }
        let gif = b"GIF89a\x01\x00\x01\x00\x00\x00\x00;";
        assert!(matches!(decode(gif, 100), Err(ImageError::Invalid(_))));
    }

    #[test]
    fn decodes_and_bounds_images() {
        let bytes = png(8, 4);
        assert_eq!(decode(&bytes, 100).unwrap().dimensions(), (8, 4));
        assert!(matches!(decode(&bytes, 31), Err(ImageError::TooLarge(_))));
        assert!(matches!(
            decode(b"hello, world", 100),
            Err(ImageError::Invalid(_))
        ));
        let truncated = &bytes[..bytes.len() / 2];
        assert!(matches!(
            decode(truncated, 100),
            Err(ImageError::Invalid(_))
        ));
    }

    #[test]
    fn normalises_to_minus_one_one() {
        let p = Preprocess {
            resize: Resize::Fixed {
                width: 2,
                height: 2,
            },
            rescale_factor: 1.0 / 255.0,
            rescale_in_f32: false,
            mean: [0.5; 3],
            std: [0.5; 3],
            do_rescale: true,
            do_normalize: true,
        };
        let img = RgbImage::from_fn(2, 2, |x, _| {
            image::Rgb([if x == 0 { 0 } else { 255 }, 0, 255])
        });
        let px = preprocess(&img, &p).unwrap().data;
        assert_eq!(px.len(), 12);
        assert_eq!(&px[0..6], &[-1.0, -1.0, 1.0, 1.0, -1.0, 1.0]);
        // Resizing keeps the shape the model wants.
        assert_eq!(preprocess(&RgbImage::new(5, 3), &p).unwrap().data.len(), 12);
    }
}
