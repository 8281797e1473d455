//! Streaming detokenization: token ids in, complete text out.
//!
//! Decoding token by token breaks in three ways: a character may span
//! several tokens (byte-level BPE pieces or SentencePiece `<0xE4>` byte
//! tokens carry partial UTF-8), decoders treat the first token of a
//! sequence specially (Metaspace/`Strip` drop its leading space), and
//! cleanup rules look at neighbours. So, like TGI and vLLM, we decode a small
//! window of recent tokens: `ids[prefix..read]` is text already emitted,
//! `ids[prefix..]` is that plus the new tokens, and the difference is
//! emitted once it no longer ends in U+FFFD (an incomplete character). After
//! each emission the window slides to start at the old `read`, so each step
//! decodes a handful of tokens, not the whole sequence.

use crate::tokenizer::{Result, Tokenizer};

/// Past this many undecodable tokens in a row the trailing U+FFFD is real
/// (invalid bytes, not a character still arriving: UTF-8 needs at most four
/// bytes), so the text is emitted anyway to keep each step's window small.
const MAX_PENDING: usize = 16;

/// Incremental decoder for one generated sequence.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Start of the decode window; text of `ids[prefix..read]` was emitted.
    prefix: usize,
    /// End of what has been emitted.
    read: usize,
}

impl StreamDecoder {
    pub fn new(tokenizer: Tokenizer, skip_special_tokens: bool) -> Self {
        StreamDecoder {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Starts after a prompt, so the first generated token decodes in
    /// context (a leading space is kept) without re-emitting the prompt.
    /// Only the last few prompt ids matter.
    pub fn with_prefix(tokenizer: Tokenizer, skip_special_tokens: bool, prompt: &[u32]) -> Self {
        let tail = &prompt[prompt.len().saturating_sub(MAX_PENDING / 2)..];
        StreamDecoder {
            tokenizer,
            skip_special_tokens,
            ids: tail.to_vec(),
            prefix: 0,
            read: tail.len(),
        }
    }

    /// Adds one token; returns the text it completes (often empty while a
    /// multi-byte character is still arriving).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix_text = self.decode(self.prefix, self.read)?;
        let new_text = self.decode(self.prefix, self.ids.len())?;
        let pending = self.ids.len() - self.read;
        if new_text.ends_with('\u{FFFD}') && pending < MAX_PENDING {
            return Ok(String::new());
        }
        let delta = suffix_after(&new_text, &prefix_text);
        self.prefix = self.read;
        self.read = self.ids.len();
        // Keep memory bounded for long generations: nothing before the
        // window is ever decoded again.
        if self.prefix > 4 * MAX_PENDING {
            self.ids.drain(..self.prefix);
            self.read -= self.prefix;
            self.prefix = 0;
        }
        Ok(delta)
    }

    /// Adds several tokens; returns the concatenated completed text.
    pub fn push_all(&mut self, ids: &[u32]) -> Result<String> {
        let mut out = String::new();
        for &id in ids {
            out.push_str(&self.push(id)?);
        }
        Ok(out)
    }

    /// Flushes whatever is still held back, with U+FFFD for bytes that never
    /// formed a character. The decoder can keep going afterwards.
    pub fn finish(&mut self) -> Result<String> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let prefix_text = self.decode(self.prefix, self.read)?;
        let new_text = self.decode(self.prefix, self.ids.len())?;
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(suffix_after(&new_text, &prefix_text))
    }

    /// Tokens pushed but not yet turned into text.
    pub fn pending_tokens(&self) -> usize {
        self.ids.len() - self.read
    }

    fn decode(&self, start: usize, end: usize) -> Result<String> {
        if start == end {
            return Ok(String::new());
        }
        self.tokenizer
            .decode(&self.ids[start..end], self.skip_special_tokens)
    }
}

/// `new` minus its leading `old`. The window's first token decodes the same
/// in both, so `old` is normally a prefix; if a decoder rewrote the boundary
/// anyway, emit from the last common character so nothing is lost.
fn suffix_after(new: &str, old: &str) -> String {
    if let Some(rest) = new.strip_prefix(old) {
        return rest.to_owned();
    }
    let common = new
        .char_indices()
        .zip(old.chars())
        .find(|((_, a), b)| a != b)
        .map_or_else(|| new.len().min(old.len()), |((i, _), _)| i);
    new[common..].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use fixtures::tokenizer::write_tokenizer;
    use fixtures::Family;

    fn tokenizer(family: Family, vocab: usize) -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), family, vocab).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    /// Streams `ids`, checking each chunk, and returns the concatenation.
    fn stream(tok: &Tokenizer, ids: &[u32], skip: bool) -> String {
        let full = tok.decode(ids, skip).unwrap();
        let mut dec = StreamDecoder::new(tok.clone(), skip);
        let mut out = String::new();
        for &id in ids {
            let chunk = dec.push(id).unwrap();
            if !full.contains('\u{FFFD}') {
                assert!(
                    !chunk.contains('\u{FFFD}'),
                    "mid-stream U+FFFD in {chunk:?}"
                );
            }
            out.push_str(&chunk);
        }
        out.push_str(&dec.finish().unwrap());
        out
    }

    const SAMPLES: &[&str] = &[
        "Hello, world! How are you today?",
        "naïve café — “quoted” ½ €100",
        "你好，世界！这是一个测试。",
        "日本語のテキストと한국어",
        "emoji 🎉🚀 and a family 👨‍👩‍👧‍👦 and flags 🇯🇵",
        "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
        "  leading spaces\tand tabs\n\nnewlines  ",
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}",
    ];

    #[test]
    fn streams_every_family_exactly() {
        for family in [Family::Qwen3, Family::Qwen2, Family::Llama, Family::Gemma3] {
            let (_d, tok) = tokenizer(family, 700);
            for text in SAMPLES {
                let ids = tok.encode(text, false).unwrap();
                assert_eq!(stream(&tok, &ids, false), *text, "{family}: {text:?}");
            }
        }
    }

    #[test]
    fn multibyte_chars_wait_for_their_last_byte() {
        // A byte-level tokenizer with no merges splits "你" (E4 BD A0) into
        // three single-byte tokens.
        let (_d, tok) = tokenizer(Family::Qwen2, 261);
        let ids = tok.encode("你", false).unwrap();
        assert_eq!(ids.len(), 3);
        let mut dec = StreamDecoder::new(tok.clone(), false);
        assert_eq!(dec.push(ids[0]).unwrap(), "");
        assert_eq!(dec.push(ids[1]).unwrap(), "");
        assert_eq!(dec.pending_tokens(), 2);
        assert_eq!(dec.push(ids[2]).unwrap(), "你");
        let emoji = tok.encode("🎉", false).unwrap();
        assert_eq!(emoji.len(), 4);
        let chunks: Vec<String> = emoji.iter().map(|&i| dec.push(i).unwrap()).collect();
        assert_eq!(chunks, ["", "", "", "🎉"]);
    }

    #[test]
    fn byte_fallback_tokens() {
        let (_d, tok) = tokenizer(Family::Gemma3, 700);
        // Gemma-style vocabularies hold no emoji, so they are spelled with
        // <0xF0><0x9F><0x8E><0x89> byte tokens.
        let ids = tok.encode("🎉", false).unwrap();
        let pieces: Vec<String> = ids.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
        assert!(
            pieces.ends_with(&["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"].map(String::from)),
            "{pieces:?}"
        );
        let mut dec = StreamDecoder::new(tok.clone(), false);
        let chunks: Vec<String> = ids.iter().map(|&i| dec.push(i).unwrap()).collect();
        assert_eq!(chunks.concat(), "🎉");
        assert_eq!(chunks.last().unwrap(), "🎉");
    }

    /// Llama 2 / Mistral style SentencePiece: a "▁" is prepended to the
    /// text and the decoder strips one leading space. Decoding each token
    /// alone would strip every word's space; the window keeps them.
    #[test]
    fn leading_space_strip_decoders_keep_inner_spaces() {
        let (dir, _) = tokenizer(Family::Gemma3, 700);
        let path = dir.path().join("tokenizer.json");
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        json["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]});
        json["decoder"] = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]});
        std::fs::write(&path, json.to_string()).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();

        let text = "one two three 你好 🎉 end";
        let ids = tok.encode(text, false).unwrap();
        let naive: String = ids
            .iter()
            .map(|&i| tok.decode(&[i], false).unwrap())
            .collect();
        assert_ne!(naive, text, "per-token decoding should lose spaces here");
        assert_eq!(stream(&tok, &ids, false), text);
        for text in SAMPLES {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(stream(&tok, &ids, false), tok.decode(&ids, false).unwrap());
        }
    }

    #[test]
    fn prompt_context_is_not_reemitted() {
        let (_d, tok) = tokenizer(Family::Llama, 700);
        let prompt = tok.encode("The answer is", true).unwrap();
        let answer = tok.encode(" forty two", false).unwrap();
        let mut dec = StreamDecoder::with_prefix(tok.clone(), true, &prompt);
        let out = dec.push_all(&answer).unwrap() + &dec.finish().unwrap();
        assert_eq!(out, " forty two");
    }

    #[test]
    fn special_tokens_can_be_skipped() {
        let (_d, tok) = tokenizer(Family::Qwen3, 700);
        let ids = tok.encode("<think>hmm</think>ok<|im_end|>", false).unwrap();
        assert_eq!(stream(&tok, &ids, true), "<think>hmm</think>ok");
        assert_eq!(stream(&tok, &ids, false), "<think>hmm</think>ok<|im_end|>");
    }

    #[test]
    fn invalid_bytes_flush_with_replacement_chars() {
        let (_d, tok) = tokenizer(Family::Qwen2, 261);
        // A lone lead byte of a 3-byte character, then nothing.
        let lead = tok.encode("你", false).unwrap()[0];
        let mut dec = StreamDecoder::new(tok.clone(), false);
        assert_eq!(dec.push(lead).unwrap(), "");
        assert_eq!(dec.finish().unwrap(), "\u{FFFD}");
        // ...and a lead byte followed by ASCII comes out at once.
        let a = tok.encode("a", false).unwrap()[0];
        assert_eq!(dec.push(lead).unwrap(), "");
        assert_eq!(dec.push(a).unwrap(), "\u{FFFD}a");
    }

    #[test]
    fn long_garbage_does_not_grow_the_window() {
        let (_d, tok) = tokenizer(Family::Qwen2, 261);
        let lead = tok.encode("你", false).unwrap()[0];
        let mut dec = StreamDecoder::new(tok.clone(), false);
        let mut out = String::new();
        for _ in 0..100 {
            out.push_str(&dec.push(lead).unwrap());
            assert!(dec.pending_tokens() < MAX_PENDING);
        }
        out.push_str(&dec.finish().unwrap());
        assert_eq!(out, tok.decode(&vec![lead; 100], false).unwrap());
    }

    /// Small deterministic PRNG (xorshift64*) so the property test needs no
    /// extra crate and failures reproduce.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Random ids; for byte-fallback vocabularies, byte tokens come in
    /// runs spelling whole characters (see the property below).
    fn random_ids(tok: &Tokenizer, rng: &mut Rng, byte_runs: bool) -> Vec<u32> {
        let n = tok.vocab_size();
        let len = 1 + rng.below(40);
        let mut ids = Vec::with_capacity(len + 4);
        while ids.len() < len {
            let id = rng.below(n) as u32;
            let is_byte = tok
                .id_to_token(id)
                .is_some_and(|t| t.len() == 6 && t.starts_with("<0x"));
            if byte_runs && is_byte {
                let c = ['é', '你', '€', '🎉', '👍', 'ß'][rng.below(6)];
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    ids.push(tok.token_to_id(&format!("<0x{b:02X}>")).unwrap());
                }
            } else {
                ids.push(id);
            }
        }
        ids
    }

    /// The streamed text equals the one-shot decode. For byte-level BPE
    /// this holds for any ids: invalid bytes become U+FFFD locally, and a
    /// chunk is only emitted at a character boundary. SentencePiece's
    /// ByteFallback decoder is not local: a run of byte tokens turns into
    /// one U+FFFD per byte as soon as any byte of the run is invalid, even
    /// bytes of characters already streamed. So there the property is
    /// checked for sequences whose byte runs are valid, and for arbitrary
    /// sequences only when their full decode is clean.
    #[test]
    fn random_sequences_stream_to_the_full_decode() {
        for (family, vocab) in [
            (Family::Qwen3, 900),
            (Family::Llama, 700),
            (Family::Qwen2, 300),
            (Family::Gemma3, 900),
        ] {
            let (_d, tok) = tokenizer(family, vocab);
            let byte_fallback = family == Family::Gemma3;
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ vocab as u64);
            let mut clean = 0;
            for case in 0..300 {
                for byte_runs in [false, true] {
                    if byte_runs && !byte_fallback {
                        continue;
                    }
                    let ids = random_ids(&tok, &mut rng, byte_runs);
                    for skip in [false, true] {
                        let full = tok.decode(&ids, skip).unwrap();
                        let streamed = stream(&tok, &ids, skip);
                        if !byte_fallback || byte_runs || !full.contains('\u{FFFD}') {
                            clean += usize::from(!full.contains('\u{FFFD}'));
                            assert_eq!(
                                streamed, full,
                                "{family} case {case} skip={skip} ids={ids:?}"
                            );
                        }
                    }
                }
            }
            if byte_fallback {
                assert!(clean > 100, "{family}: only {clean} clean sequences tested");
            }
            // Real text, cut at a random token, must also round-trip.
            for text in SAMPLES {
                let ids = tok.encode(text, false).unwrap();
                let part = &ids[rng.below(ids.len())..];
                assert_eq!(stream(&tok, part, false), tok.decode(part, false).unwrap());
            }
        }
    }
}
