//! What the speculative benches share: one request's stream read to its end,
//! and the prompt whose answer a JSON Schema constrains.

use std::time::Instant;

use engine_core::{Engine, Event, GenerateRequest, Grammar, SpecStats};

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

#[allow(dead_code)]
pub const RECORD: &str = "Customer record:\n\nname: Ada Lovelace\nemail: ada.lovelace@example.com\ncity: London\ncountry: United Kingdom\nphone: +44 20 7946 0958\nmember_since: 2019\n\nReturn this record as a JSON object with the keys name, email, city, country, phone and member_since.";

/// The record prompt's answer: its keys in order, values of their types.
#[allow(dead_code)]
pub fn record_schema() -> Grammar {
    let text = |max: u32| serde_json::json!({"type": "string", "maxLength": max});
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": text(40), "email": text(60), "city": text(40), "country": text(40),
            "phone": text(30), "member_since": {"type": "integer", "minimum": 1900, "maximum": 2100},
        },
        "required": ["name", "email", "city", "country", "phone", "member_since"],
        "additionalProperties": false,
    });
    Grammar::JsonSchema(schema.to_string())
}

/// `client(i)` for clients `0..c` at once, each on its own thread, or one
/// after another when `serial` (an engine that serves one request at a
/// time, the fast path); their results in client order.
#[allow(dead_code)]
pub fn clients<T: Send>(c: usize, serial: bool, client: impl Fn(usize) -> T + Sync) -> Vec<T> {
    if serial {
        return (0..c).map(&client).collect();
    }
    std::thread::scope(|s| {
        let client = &client;
        let handles: Vec<_> = (0..c).map(|i| s.spawn(move || client(i))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
