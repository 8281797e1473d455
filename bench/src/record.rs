//! What one streamed request measured, built from its events as they
//! arrive: first and later content chunks, the usage chunk, `[DONE]`.

use std::time::{Duration, Instant};

use serde_json::Value;
use sse::SseEvent;

/// One request's outcome. Times are seconds from sending the request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    /// `None` when the request succeeded; else a short kind (`http_429`,
    /// `connect`, `broken_stream`, `stream_error`, `timeout`).
    pub error: Option<String>,
    /// Time to the first chunk carrying output (text, reasoning or a tool
    /// call); `None` when nothing was generated.
    pub ttft: Option<f64>,
    /// Gaps between consecutive output chunks.
    pub itl: Vec<f64>,
    /// Time to the end of the response.
    pub e2e: f64,
    /// From the usage chunk when the server sends one, else output chunks.
    pub output_tokens: u64,
    pub prompt_tokens: Option<u64>,
    /// The engine our gateway names in `x-engine` (other servers: none).
    pub engine: Option<String>,
}

impl RequestRecord {
    pub fn failed(kind: impl Into<String>, elapsed: Duration, engine: Option<String>) -> Self {
        RequestRecord {
            error: Some(kind.into()),
            ttft: None,
            itl: Vec::new(),
            e2e: elapsed.as_secs_f64(),
            output_tokens: 0,
            prompt_tokens: None,
            engine,
        }
    }

    /// Time per output token after the first.
    pub fn tpot(&self) -> Option<f64> {
        let ttft = self.ttft?;
        (self.output_tokens >= 2).then(|| (self.e2e - ttft) / (self.output_tokens - 1) as f64)
    }

    /// This request's output tokens over its whole latency.
    pub fn output_tok_s(&self) -> Option<f64> {
        (self.error.is_none() && self.e2e > 0.0).then(|| self.output_tokens as f64 / self.e2e)
    }
}

/// Folds a response's events into a record.
pub struct StreamTracker {
    start: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    itl: Vec<f64>,
    chunks: u64,
    usage_completion: Option<u64>,
    usage_prompt: Option<u64>,
    error: Option<String>,
    done: bool,
}

impl StreamTracker {
    pub fn new(start: Instant) -> Self {
        StreamTracker {
            start,
            first: None,
            last: None,
            itl: Vec::new(),
            chunks: 0,
            usage_completion: None,
            usage_prompt: None,
            error: None,
            done: false,
        }
    }

    /// One event's data, received at `at`.
    pub fn on_event(&mut self, event: SseEvent, at: Instant) {
        let data = match event {
            SseEvent::Done => {
                self.done = true;
                return;
            }
            SseEvent::Data(data) => data,
        };
        let Ok(chunk) = serde_json::from_str::<Value>(&data) else {
            self.error.get_or_insert_with(|| "bad_chunk".into());
            return;
        };
        if chunk.get("error").is_some_and(|e| !e.is_null()) {
            self.error.get_or_insert_with(|| "stream_error".into());
            return;
        }
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            self.usage_completion = usage["completion_tokens"]
                .as_u64()
                .or(self.usage_completion);
            self.usage_prompt = usage["prompt_tokens"].as_u64().or(self.usage_prompt);
        }
        let has_output = chunk["choices"]
            .as_array()
            .is_some_and(|choices| choices.iter().any(carries_output));
        if has_output {
            self.chunks += 1;
            if let Some(last) = self.last {
                self.itl.push((at - last).as_secs_f64());
            }
            self.first.get_or_insert(at);
            self.last = Some(at);
        }
    }

    /// The record once the body ended at `at` (`broken`: the connection
    /// failed mid-body).
    pub fn finish(self, at: Instant, broken: bool, engine: Option<String>) -> RequestRecord {
        let error = self
            .error
            .or_else(|| (broken || !self.done).then(|| "broken_stream".to_owned()));
        RequestRecord {
            error,
            ttft: self.first.map(|t| (t - self.start).as_secs_f64()),
            itl: self.itl,
            e2e: (at - self.start).as_secs_f64(),
            output_tokens: self.usage_completion.unwrap_or(self.chunks),
            prompt_tokens: self.usage_prompt,
            engine,
        }
    }
}

/// Whether a choice carries generated output: completion text, chat
/// content or reasoning, or a tool call.
fn carries_output(choice: &Value) -> bool {
    let non_empty = |v: &Value| v.as_str().is_some_and(|s| !s.is_empty());
    let delta = &choice["delta"];
    non_empty(&choice["text"])
        || non_empty(&delta["content"])
        || non_empty(&delta["reasoning_content"])
        || non_empty(&delta["reasoning"])
        || delta["tool_calls"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(data: &str) -> SseEvent {
        match data {
            "[DONE]" => SseEvent::Done,
            _ => SseEvent::Data(data.to_owned()),
        }
    }

    fn at(start: Instant, ms: u64) -> Instant {
        start + Duration::from_millis(ms)
    }

    #[test]
    fn chat_stream_with_usage() {
        let s = Instant::now();
        let mut t = StreamTracker::new(s);
        t.on_event(
            ev(r#"{"choices":[{"delta":{"role":"assistant"}}]}"#),
            at(s, 5),
        );
        t.on_event(
            ev(r#"{"choices":[{"delta":{"reasoning_content":"hm"}}]}"#),
            at(s, 100),
        );
        t.on_event(ev(r#"{"choices":[{"delta":{"content":"a"}}]}"#), at(s, 130));
        t.on_event(
            ev(r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#),
            at(s, 170),
        );
        t.on_event(
            ev(r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":7}}"#),
            at(s, 171),
        );
        t.on_event(ev("[DONE]"), at(s, 172));
        let r = t.finish(at(s, 175), false, Some("batched".into()));
        assert_eq!(r.error, None);
        assert_eq!(r.ttft, Some(0.1));
        assert_eq!(r.itl.len(), 2);
        assert!((r.itl[0] - 0.03).abs() < 1e-9 && (r.itl[1] - 0.04).abs() < 1e-9);
        assert_eq!((r.output_tokens, r.prompt_tokens), (7, Some(9)));
        assert!((r.tpot().unwrap() - 0.075 / 6.0).abs() < 1e-9);
        assert!((r.e2e - 0.175).abs() < 1e-9);
    }

    #[test]
    fn completions_without_usage_count_chunks() {
        let s = Instant::now();
        let mut t = StreamTracker::new(s);
        for (i, text) in ["x", "", "y", "z"].iter().enumerate() {
            let chunk = serde_json::json!({"choices": [{"text": text}]}).to_string();
            t.on_event(ev(&chunk), at(s, 10 * (i as u64 + 1)));
        }
        t.on_event(ev("[DONE]"), at(s, 50));
        let r = t.finish(at(s, 50), false, None);
        assert_eq!(
            (r.output_tokens, r.itl.len(), r.error.as_deref()),
            (3, 2, None)
        );
    }

    #[test]
    fn broken_and_failed_streams() {
        let s = Instant::now();
        let mut t = StreamTracker::new(s);
        t.on_event(ev(r#"{"choices":[{"text":"a"}]}"#), at(s, 10));
        let r = t.finish(at(s, 20), false, None);
        assert_eq!(r.error.as_deref(), Some("broken_stream"));
        let mut t = StreamTracker::new(s);
        t.on_event(ev(r#"{"error":{"message":"boom"}}"#), at(s, 10));
        t.on_event(ev("[DONE]"), at(s, 11));
        assert_eq!(
            t.finish(at(s, 12), false, None).error.as_deref(),
            Some("stream_error")
        );
    }
}
