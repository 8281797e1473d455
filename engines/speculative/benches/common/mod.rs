//! What the speculative benches share: one request's stream read to its end.

use std::time::Instant;

use engine_core::{Engine, Event, GenerateRequest, SpecStats};

/// A finished request: its tokens, the seconds from its first token to its
/// end (decode, prefill excluded) and the engine's speculation counts.
pub struct Streamed {
    pub tokens: Vec<u32>,
    pub decode_seconds: f64,
    pub spec: Option<SpecStats>,
}

impl Streamed {
    /// Tokens decoded after the first. (Each bench compiles this module on
    /// its own, and not every one counts them.)
    #[allow(dead_code)]
    pub fn decode_tokens(&self) -> usize {
        self.tokens.len().saturating_sub(1)
    }
}

/// Submits `request` and reads its stream to the end; an error panics.
pub fn stream(engine: &dyn Engine, request: GenerateRequest) -> Streamed {
    let mut stream = engine.submit(request).expect("submit");
    let (mut tokens, mut first, mut spec) = (Vec::new(), None::<Instant>, None);
    while let Some(ev) = stream.blocking_recv() {
        match ev {
            Event::Token(t) => {
                first.get_or_insert_with(Instant::now);
                tokens.push(t.id);
            }
            Event::Finished(f) => {
                spec = f.spec;
                break;
            }
            Event::Error(e) => panic!("{e}"),
        }
    }
    Streamed {
        tokens,
        decode_seconds: first.map_or(0.0, |t| t.elapsed().as_secs_f64()),
        spec,
    }
}
