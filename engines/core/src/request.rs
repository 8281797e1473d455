//! The validated generation request: token ids in, sampling parameters set.
//! Engines only ever see this type; parsing and validation of the raw API
//! request happen once, in the gateway.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Process-unique request id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(pub u64);

impl RequestId {
    pub fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        RequestId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// Set by whoever wants the request stopped (client disconnect, stop string,
/// shutdown); engines check it between steps.
#[derive(Clone)]
pub struct CancelToken(Arc<dyn CancelFlag>);

/// The flag behind a [`CancelToken`]: an atomic in this image, or the
/// host's through C for an engine in a plugin (`plugin::handles`).
pub trait CancelFlag: Send + Sync {
    fn cancel(&self);
    fn is_cancelled(&self) -> bool;
}

impl CancelFlag for AtomicBool {
    fn cancel(&self) {
        self.store(true, Ordering::Release)
    }

    fn is_cancelled(&self) -> bool {
        self.load(Ordering::Acquire)
    }
}

impl Default for CancelToken {
    fn default() -> Self {
        Self::with_flag(AtomicBool::new(false))
    }
}

impl std::fmt::Debug for CancelToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CancelToken({})", self.is_cancelled())
    }
}

impl CancelToken {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_flag(flag: impl CancelFlag + 'static) -> Self {
        CancelToken(Arc::new(flag))
    }

    pub fn cancel(&self) {
        self.0.cancel()
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.is_cancelled()
    }
}

/// Sampling parameters, already range-checked by the gateway.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 1.0 disables nucleus truncation.
    pub top_p: f32,
    /// 0 disables top-k truncation.
    pub top_k: u32,
    /// 0.0 disables min-p truncation.
    pub min_p: f32,
    /// 1.0 disables the repetition penalty.
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Added to the logits of these token ids before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
    /// How many alternatives to report per token (0: only the chosen
    /// token's logprob when `logprobs` is set).
    pub top_logprobs: u32,
    pub logprobs: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
            top_logprobs: 0,
            logprobs: false,
        }
    }
}

/// The sampling a checkpoint ships (`generation_config.json`, a GGUF's
/// `general.sampling.*`): what a request that leaves a knob out gets, as
/// vLLM does. `None`: the knob is not set there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl SamplingDefaults {
    /// Fills in what the request did not `give` (by parameter name). The
    /// truncations (top-p, top-k, min-p) only where it samples: they never
    /// change a greedy pick, and a greedy request stays plain greedy.
    pub fn apply(&self, s: &mut SamplingParams, given: impl Fn(&str) -> bool) {
        let fill = |name: &str, default: Option<f32>, slot: &mut f32| {
            if let Some(v) = default.filter(|_| !given(name)) {
                *slot = v;
            }
        };
        fill("temperature", self.temperature, &mut s.temperature);
        fill(
            "repetition_penalty",
            self.repetition_penalty,
            &mut s.repetition_penalty,
        );
        if s.is_greedy() {
            return;
        }
        fill("top_p", self.top_p, &mut s.top_p);
        fill("min_p", self.min_p, &mut s.min_p);
        if let Some(k) = self.top_k.filter(|_| !given("top_k")) {
            s.top_k = k;
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
    }
}

/// A validated generation request. It crosses the plugin boundary as JSON,
/// its images' embeddings and its cancel token beside it in C form
/// (`plugin::wire`). A field added later carries `#[serde(default)]`, so
/// plugins built before it and after it still read each other's requests.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub sampling: SamplingParams,
    /// Token ids that end generation (the model's full EOS set plus any
    /// the request adds). The stop token itself is not streamed.
    pub stop_tokens: Vec<u32>,
    /// Prefix-cache reuse happens only between requests of the same scope.
    pub cache_scope: Option<String>,
    pub has_tools: bool,
    /// Image soft tokens of the prompt and their embeddings (vision
    /// models); empty for text-only requests.
    pub images: Vec<ImageInput>,
    /// Constrains decoding to this grammar (structured outputs); engines
    /// that cannot apply token masks say so in their capabilities.
    #[serde(default)]
    pub grammar: Option<Grammar>,
    #[serde(skip)]
    pub cancel: CancelToken,
}

/// A grammar the output must match, as plain data: each engine compiles it
/// against the model's tokenizer (the `grammar` crate).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "type", content = "source", rename_all = "snake_case")]
pub enum Grammar {
    /// A JSON Schema, as JSON text.
    JsonSchema(String),
    /// A regular expression over the whole output (Rust `regex` syntax).
    Regex(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// `then` after a reasoning block the model writes first, free inside:
    /// `open` (absent when the prompt already opened the block, which the
    /// model must then close) up to `close`.
    AfterReasoning {
        open: Option<String>,
        close: String,
        then: Box<Grammar>,
    },
    /// `grammar` with `generated` already written under it: a request
    /// continued in a new leg (after a thinking budget) resumes its state.
    Continued {
        grammar: Box<Grammar>,
        generated: Vec<u32>,
    },
}

/// One image in the prompt: the prompt positions `[start, start + tokens)`
/// hold its soft-token placeholders, whose input embeddings engines replace
/// with `embeddings` (`tokens` rows of `width` floats, in the text model's
/// embedding units).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageInput {
    pub start: u32,
    pub tokens: u32,
    pub width: u32,
    /// Crosses the plugin boundary as floats, not JSON (`plugin::wire`).
    #[serde(skip)]
    pub embeddings: Arc<Vec<f32>>,
    /// The image's tokens attend to each other in both directions during
    /// prefill (Hugging Face's rule; the model decides on which layers:
    /// Gemma 3 all, Gemma 4 its sliding-window ones); otherwise causally.
    /// Engines then prefill each image within one chunk.
    pub bidirectional: bool,
}

impl ImageInput {
    pub fn end(&self) -> u32 {
        self.start + self.tokens
    }
}

impl GenerateRequest {
    /// Plain argmax decoding with nothing that needs per-step bookkeeping
    /// (no truncation, penalties, seed or logprobs): what the router calls
    /// greedy, what the fast path and the speculative engines serve, and
    /// what the batched engine decodes with one shared argmax. The one
    /// definition; everything asks here.
    pub fn is_plain_greedy(&self) -> bool {
        let s = &self.sampling;
        s.is_greedy()
            && s.top_p >= 1.0
            && s.top_k == 0
            && s.min_p <= 0.0
            && s.seed.is_none()
            && !s.has_penalties()
            && !s.logprobs
    }

    pub fn new(prompt: Vec<u32>, max_tokens: u32) -> Self {
        Self {
            id: RequestId::next(),
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
            cache_scope: None,
            has_tools: false,
            images: Vec::new(),
            grammar: None,
            cancel: CancelToken::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_greedy_is_argmax_without_bookkeeping() {
        let mut req = GenerateRequest::new(vec![1], 1);
        assert!(req.is_plain_greedy());
        req.sampling.logprobs = true;
        assert!(
            !req.is_plain_greedy(),
            "logprobs need the full distribution"
        );
        req.sampling = SamplingParams {
            seed: Some(1),
            ..SamplingParams::greedy()
        };
        assert!(!req.is_plain_greedy());
        req.sampling = SamplingParams {
            temperature: 0.5,
            ..SamplingParams::greedy()
        };
        assert!(!req.is_plain_greedy());
    }
}
