//! Image soft tokens in the prompt. The chat template writes one marker per
//! image; before tokenizing, each marker becomes the image's delimited run
//! of soft tokens, as the family's processor writes it:
//!
//! * Gemma 3: the marker is `<start_of_image>`, replaced with
//!   `\n\n<start_of_image>` + `<image_soft_token>` x N + `<end_of_image>\n\n`;
//! * Gemma 4: the marker is the soft token `<|image|>` itself, replaced with
//!   `<|image>` + `<|image|>` x N + `<image|>`, N depending on the image.
//!
//! Then each image's soft-token run is found in the ids.

use runtime::vision::TowerKind;

use super::ImageError;

/// The image tokens' text and ids for the loaded model.
#[derive(Debug, Clone)]
pub struct ImageTokens {
    /// What the chat template writes where an image goes.
    pub marker: String,
    /// Around the delimited run (Gemma 3's blank lines).
    pub padding: &'static str,
    pub boi: String,
    pub eoi: String,
    pub soft: String,
    pub soft_id: u32,
}

impl ImageTokens {
    /// The loaded model's: its config's ids, their text from `tokenizer`,
    /// the marker and padding its family's processor uses.
    pub fn for_model(
        cfg: &runtime::vision::VisionConfig,
        tokenizer: &text::Tokenizer,
    ) -> anyhow::Result<Self> {
        let text = |id: u32| -> anyhow::Result<String> {
            tokenizer
                .id_to_token(id)
                .ok_or_else(|| anyhow::anyhow!("the tokenizer has no image token with id {id}"))
        };
        let (boi, soft) = (text(cfg.boi_token_id)?, text(cfg.image_token_id)?);
        let (marker, padding) = match cfg.tower {
            TowerKind::Gemma3 { .. } => (boi.clone(), "\n\n"),
            TowerKind::Gemma4(_) => (soft.clone(), ""),
        };
        Ok(Self {
            marker,
            padding,
            boi,
            eoi: text(cfg.eoi_token_id)?,
            soft,
            soft_id: cfg.image_token_id,
        })
    }

    /// `rendered` with every image marker expanded to its image's `counts`
    /// soft tokens; fails unless there is exactly one marker per image.
    pub fn expand(&self, rendered: &str, counts: &[usize]) -> Result<String, ImageError> {
        let pieces: Vec<&str> = rendered.split(self.marker.as_str()).collect();
        let markers = pieces.len() - 1;
        if markers != counts.len() {
            return Err(ImageError::Invalid(format!(
                "the prompt holds {markers} image markers ({}) for {} images; do not write image tokens in text",
                self.marker,
                counts.len()
            )));
        }
        let mut out = String::with_capacity(rendered.len() + counts.iter().sum::<usize>() * 8);
        out.push_str(pieces[0]);
        for (piece, &n) in pieces[1..].iter().zip(counts) {
            let pad = self.padding;
            out.push_str(&format!(
                "{pad}{}{}{}{pad}",
                self.boi,
                self.soft.repeat(n),
                self.eoi
            ));
            out.push_str(piece);
        }
        Ok(out)
    }

    /// Start of every image's soft tokens in `prompt`, checked against the
    /// images' counts.
    pub fn spans(&self, prompt: &[u32], counts: &[usize]) -> Result<Vec<usize>, ImageError> {
        let spans = runtime::vision::image_spans(prompt, self.soft_id);
        if spans.len() != counts.len() || spans.iter().zip(counts).any(|(&(_, len), &n)| len != n) {
            return Err(ImageError::Invalid(format!(
                "the prompt's image tokens do not match its {} images; do not write image tokens in text",
                counts.len()
            )));
        }
        Ok(spans.into_iter().map(|(start, _)| start).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemma3() -> ImageTokens {
        ImageTokens {
            marker: "<boi>".into(),
            padding: "\n\n",
            boi: "<boi>".into(),
            eoi: "<eoi>".into(),
            soft: "<img>".into(),
            soft_id: 9,
        }
    }

    #[test]
    fn expands_each_marker() {
        let t = gemma3();
        assert_eq!(
            t.expand("a<boi>b", &[2]).unwrap(),
            "a\n\n<boi><img><img><eoi>\n\nb"
        );
        assert!(t.expand("a<boi>b<boi>", &[2]).is_err());
        assert!(t.expand("ab", &[2]).is_err());
        // Gemma 4: the soft token is the marker, each image its own count.
        let g4 = ImageTokens {
            marker: "<img>".into(),
            padding: "",
            ..gemma3()
        };
        assert_eq!(
            g4.expand("a<img>b<img>", &[1, 3]).unwrap(),
            "a<boi><img><eoi>b<boi><img><img><img><eoi>"
        );
        assert!(g4.expand("a<img><img>", &[1]).is_err());
    }

    #[test]
    fn spans_must_match_the_images() {
        let t = gemma3();
        assert_eq!(t.spans(&[1, 9, 9, 2, 9, 9], &[2, 2]).unwrap(), vec![1, 4]);
        assert_eq!(t.spans(&[1, 9, 2, 9, 9, 9], &[1, 3]).unwrap(), vec![1, 3]);
        assert!(t.spans(&[1, 9, 9, 9], &[2]).is_err());
        assert!(t.spans(&[1, 9, 9], &[2, 2]).is_err());
        assert!(t.spans(&[1, 9, 2, 9, 9, 9], &[3, 1]).is_err());
    }
}
