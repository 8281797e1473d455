//! Token log-probabilities in the two wire formats: chat's `logprobs.content`
//! and the legacy completions object.

use engine_core::TokenEvent;
use serde_json::{json, Map, Value};
use text::Tokenizer;

fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

/// `{"content": [{token, logprob, bytes, top_logprobs: [...]}]}`
pub fn chat(tokenizer: &Tokenizer, tokens: &[TokenEvent]) -> Value {
    // An engine that did not fill a logprob gets null rather than a guess.
    let entry = |id: u32, logprob: Option<f32>| {
        let text = token_text(tokenizer, id);
        let bytes: Vec<u8> = text.as_bytes().to_vec();
        json!({ "token": text, "logprob": logprob, "bytes": bytes })
    };
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(t.id, t.logprob);
            e["top_logprobs"] = t
                .top_logprobs
                .iter()
                .map(|&(id, lp)| entry(id, Some(lp)))
                .collect();
            e
        })
        .collect();
    json!({ "content": content })
}

/// `{tokens, token_logprobs, top_logprobs, text_offset}`; `offset` is where
/// this batch's text starts in the whole completion.
pub fn completion(tokenizer: &Tokenizer, tokens: &[TokenEvent], mut offset: usize) -> Value {
    let mut texts = Vec::with_capacity(tokens.len());
    let mut offsets = Vec::with_capacity(tokens.len());
    let mut top = Vec::with_capacity(tokens.len());
    for t in tokens {
        let text = token_text(tokenizer, t.id);
        offsets.push(offset);
        offset += text.len();
        texts.push(text);
        let alternatives: Map<String, Value> = t
            .top_logprobs
            .iter()
            .map(|&(id, lp)| (token_text(tokenizer, id), json!(lp)))
            .collect();
        top.push(Value::Object(alternatives));
    }
    json!({
        "tokens": texts,
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    })
}
