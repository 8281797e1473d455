//! Our image preprocessing and prompt expansion against the reference:
//! mlx-vlm's Gemma 3 processor (Hugging Face's image processor: PIL
//! bilinear resize, rescale, normalise; the `<start_of_image>` expansion)
//! and Gemma 4 processor (aspect-preserving PIL bicubic resize, rescale;
//! per-image soft-token counts) on the same files. Prompt ids must be equal; pixels equal for images at
//! the model's size and within a few 8-bit levels where resizing happens
//! (PIL's and the `image` crate's bilinear filters round differently).

use std::io::Cursor;
use std::path::Path;

use fixtures::gemma4::Layout;
use fixtures::vision::{
    write_gemma4_vision_model, write_vision_model, TinyGemma4VisionSpec, TinyVisionSpec, BOI,
    GEMMA4_IMAGE_TOKEN,
};
use gateway::vision::pixels::{decode, preprocess};
use gateway::vision::ImageTokens;
use image::{ImageFormat, Rgb, RgbImage};
use runtime::vision::VisionConfig;
use serde_json::json;

fn picture(w: u32, h: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        Rgb([
            (x * 5 % 256) as u8,
            (y * 3 % 256) as u8,
            ((x * y) % 256) as u8,
        ])
    })
}

/// Writes each image to `dir` and runs mlx-vlm's processor on `prompt`
/// with it, one case per image.
/// The worst and the mean absolute difference of two pixel tensors.
fn pixel_differences(ours: &[f32], theirs: &[f32]) -> (f32, f32) {
    let diffs: Vec<f32> = ours
        .iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .collect();
    let worst = diffs.iter().cloned().fold(0f32, f32::max);
    (worst, diffs.iter().sum::<f32>() / diffs.len() as f32)
}

fn reference_processor<'a>(
    dir: &Path,
    model: &Path,
    prompt: &str,
    images: impl Iterator<Item = (&'a str, ImageFormat, &'a RgbImage)>,
) -> serde_json::Value {
    let mut cases = Vec::new();
    for (name, format, img) in images {
        let path = dir.join(name);
        let mut bytes = Cursor::new(Vec::new());
        img.write_to(&mut bytes, format).unwrap();
        std::fs::write(&path, bytes.into_inner()).unwrap();
        cases.push(json!({"prompt": prompt, "images": [path]}));
    }
    let req = json!({"model": model, "processor": cases});
    fixtures::reference::run("mlx_vlm_oracle.py", &req)
}

#[test]
fn pixels_and_prompt_ids_match_the_reference_processor() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_vision_model(&model, &TinyVisionSpec::tiny()).unwrap();
    let cfg = VisionConfig::from_dir(&model).unwrap().unwrap();
    let tokenizer = text::Tokenizer::from_dir(&model).unwrap();

    // (file, format, resized?)
    let files = [
        ("same.png", ImageFormat::Png, picture(56, 56), false),
        ("down.png", ImageFormat::Png, picture(97, 61), true),
        ("up.jpg", ImageFormat::Jpeg, picture(40, 30), true),
    ];
    let prompt =
        format!("<bos><start_of_turn>user\nLook{BOI}<end_of_turn>\n<start_of_turn>model\n");
    let images = files
        .iter()
        .map(|(name, format, img, _)| (*name, *format, img));
    let reference = reference_processor(dir.path(), &model, &prompt, images);

    let tokens = ImageTokens::for_model(&cfg, &tokenizer).unwrap();
    let per_image = cfg.fixed_soft_tokens().unwrap();
    let ours_ids = tokenizer
        .encode_chat(&tokens.expand(&prompt, &[per_image]).unwrap())
        .unwrap();
    for (k, (name, _, _, resized)) in files.iter().enumerate() {
        let theirs = &reference["processed"][k];
        let ids: Vec<u32> = serde_json::from_value(theirs["ids"].clone()).unwrap();
        assert_eq!(
            ours_ids, ids,
            "{name}: prompt ids differ from the processor's"
        );
        let bytes = std::fs::read(dir.path().join(name)).unwrap();
        let ours = preprocess(&decode(&bytes, 1 << 20).unwrap(), &cfg.preprocess)
            .unwrap()
            .data;
        let theirs: Vec<f32> = serde_json::from_value(theirs["pixels"].clone()).unwrap();
        assert_eq!(ours.len(), theirs.len(), "{name}");
        let (worst, mean) = pixel_differences(&ours, &theirs);
        let level = 2.0 / 255.0;
        eprintln!("{name}: worst pixel difference {worst}, mean {mean}");
        if *resized {
            assert!(
                worst <= 2.0 * level + 1e-6 && mean <= 0.25 * level,
                "{name}: resized pixels differ by up to {worst} (mean {mean})"
            );
        } else {
            assert!(worst <= 1e-6, "{name}: pixels differ by {worst}");
        }
    }
}

/// Gemma 4: each image resized (bicubic, keeping its aspect ratio) to fit
/// the patch budget, rescaled to [0, 1], and its own soft-token count in
/// `<|image>` ... `<image|>` where the template wrote `<|image|>`.
#[test]
fn gemma4_pixels_and_prompt_ids_match_the_reference_processor() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_gemma4_vision_model(&model, &TinyGemma4VisionSpec::tiny(Layout::HfMultimodal)).unwrap();
    let cfg = VisionConfig::from_dir(&model).unwrap().unwrap();
    let tokenizer = text::Tokenizer::from_dir(&model).unwrap();
    let tokens = ImageTokens::for_model(&cfg, &tokenizer).unwrap();

    // (file, format, worst difference allowed in 8-bit levels): kept at
    // 32x32 (16 tokens) and 16x48 (12); shrunk from 97x61 to 40x24 (15);
    // grown from 20x14 to 32x24 (12); a thin one to one tile across (128x8,
    // 16), where the two bicubic filters part most at the edges (up to 8
    // levels on a few pixels; the mean is still under a quarter level).
    let files = [
        ("square.png", ImageFormat::Png, picture(32, 32), 0.0),
        ("tall.png", ImageFormat::Png, picture(16, 48), 0.0),
        ("down.png", ImageFormat::Png, picture(97, 61), 2.0),
        ("up.jpg", ImageFormat::Jpeg, picture(20, 14), 2.0),
        ("thin.png", ImageFormat::Png, picture(200, 6), 8.0),
    ];
    let prompt = format!(
        "<bos><start_of_turn>user\nLook{GEMMA4_IMAGE_TOKEN}<end_of_turn>\n<start_of_turn>model\n"
    );
    let images = files
        .iter()
        .map(|(name, format, img, _)| (*name, *format, img));
    let reference = reference_processor(dir.path(), &model, &prompt, images);
    let mut counts = Vec::new();
    for (k, (name, _, _, levels)) in files.iter().enumerate() {
        let theirs = &reference["processed"][k];
        let bytes = std::fs::read(dir.path().join(name)).unwrap();
        let (w, h) = gateway::vision::pixels::dimensions(&bytes, 1 << 20).unwrap();
        let n = cfg.soft_tokens(w, h).unwrap();
        counts.push(n);
        let ours_ids = tokenizer
            .encode_chat(&tokens.expand(&prompt, &[n]).unwrap())
            .unwrap();
        let ids: Vec<u32> = serde_json::from_value(theirs["ids"].clone()).unwrap();
        assert_eq!(
            ours_ids, ids,
            "{name}: prompt ids differ from the processor's"
        );
        let ours = preprocess(&decode(&bytes, 1 << 20).unwrap(), &cfg.preprocess).unwrap();
        let shape: Vec<Vec<u32>> = serde_json::from_value(theirs["shapes"].clone()).unwrap();
        assert_eq!(shape, vec![vec![ours.height, ours.width]], "{name}: size");
        let theirs: Vec<f32> = serde_json::from_value(theirs["pixels"].clone()).unwrap();
        assert_eq!(ours.data.len(), theirs.len(), "{name}");
        let (worst, mean) = pixel_differences(&ours.data, &theirs);
        let level = 1.0 / 255.0;
        eprintln!(
            "{name}: {}x{} -> {}x{}, {n} soft tokens, worst pixel difference {worst}, mean {mean}",
            w, h, ours.width, ours.height
        );
        if *levels > 0.0 {
            assert!(
                worst <= levels * level + 1e-6 && mean <= 0.25 * level,
                "{name}: resized pixels differ by up to {worst} (mean {mean})"
            );
        } else {
            assert_eq!(worst, 0.0, "{name}: pixels differ by {worst}");
        }
    }
    assert_eq!(counts[..2], [16, 12]);
}
