//! Image soft tokens in the prompt. The chat template writes one
//! `<start_of_image>` per image; like Gemma 3's processor we replace each
//! with `\n\n<start_of_image>` + `<image_soft_token>` x N + `<end_of_image>\n\n`
//! before tokenizing, then find each image's soft-token run in the ids.

use super::ImageError;

/// The image tokens' text and ids for the loaded model.
#[derive(Debug, Clone)]
pub struct ImageTokens {
    pub boi: String,
    pub eoi: String,
    pub soft: String,
    pub soft_id: u32,
    pub per_image: usize,
}

impl ImageTokens {
    /// `rendered` with every image marker expanded; fails unless there is
    /// exactly one marker per image.
    pub fn expand(&self, rendered: &str, images: usize) -> Result<String, ImageError> {
        let markers = rendered.matches(&self.boi).count();
        if markers != images {
            return Err(ImageError::Invalid(format!(
                "the prompt holds {markers} image markers ({}) for {images} images; do not write image tokens in text",
                self.boi
            )));
        }
        let full = format!(
            "\n\n{}{}{}\n\n",
            self.boi,
            self.soft.repeat(self.per_image),
            self.eoi
        );
        Ok(rendered.replace(&self.boi, &full))
    }

    /// Start of every image's soft tokens in `prompt`, checked against the
    /// expected count and length.
    pub fn spans(&self, prompt: &[u32], images: usize) -> Result<Vec<usize>, ImageError> {
        let spans = runtime::vision::image_spans(prompt, self.soft_id);
        if spans.len() != images || spans.iter().any(|&(_, len)| len != self.per_image) {
            return Err(ImageError::Invalid(format!(
                "the prompt's image tokens do not match its {images} images; do not write image tokens in text"
            )));
        }
        Ok(spans.into_iter().map(|(start, _)| start).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens() -> ImageTokens {
        ImageTokens {
            boi: "<boi>".into(),
            eoi: "<eoi>".into(),
            soft: "<img>".into(),
            soft_id: 9,
            per_image: 2,
        }
    }

    #[test]
    fn expands_each_marker() {
        let t = tokens();
        assert_eq!(
            t.expand("a<boi>b", 1).unwrap(),
            "a\n\n<boi><img><img><eoi>\n\nb"
        );
        assert!(t.expand("a<boi>b<boi>", 1).is_err());
        assert!(t.expand("ab", 1).is_err());
    }

    #[test]
    fn spans_must_match_the_images() {
        let t = tokens();
        assert_eq!(t.spans(&[1, 9, 9, 2, 9, 9], 2).unwrap(), vec![1, 4]);
        assert!(t.spans(&[1, 9, 9, 9], 1).is_err());
        assert!(t.spans(&[1, 9, 9], 2).is_err());
    }
}
