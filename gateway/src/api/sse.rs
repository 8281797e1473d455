//! Server-sent events for streamed completions: `data: {json}\n\n` frames,
//! ending with `data: [DONE]`. The body owns the `Generation`, so a client
//! that disconnects drops the body and thereby cancels the request in its
//! engine at once.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use futures_util::stream;
use serde_json::Value;

use crate::generation::{Batch, Generation, Summary};

/// How an endpoint turns generation output into its chunk objects.
pub trait ChunkFormat: Send + 'static {
    /// Chunks before any token (chat: the one carrying the role).
    fn opening(&mut self) -> Vec<Value>;
    fn batch(&mut self, batch: &Batch) -> Vec<Value>;
    /// The chunk with `finish_reason`, then the usage chunk when asked for.
    fn closing(&mut self, summary: &Summary) -> Vec<Value>;
    /// Whether each frame names its event (`event: <type>`), as the
    /// Responses API's stream does.
    fn named_events(&self) -> bool {
        false
    }
}

/// The last chunk of a stream that asked for `stream_options.include_usage`:
/// no choices, only the usage.
pub fn usage_chunk(id: &str, object: &str, created: u64, model: &str, summary: &Summary) -> Value {
    serde_json::json!({
        "id": id,
        "object": object,
        "created": created,
        "model": model,
        "choices": [],
        "usage": summary.usage.to_json(),
    })
}

enum Phase {
    Opening,
    Running,
    Ended,
}

struct StreamState<F> {
    generation: Generation,
    format: F,
    phase: Phase,
}

const DONE: &[u8] = b"data: [DONE]\n\n";

pub fn frame(out: &mut Vec<u8>, value: &Value) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(value.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// A frame with an `event:` line naming the value's `type`.
fn named_frame(out: &mut Vec<u8>, value: &Value) {
    if let Some(kind) = value.get("type").and_then(Value::as_str) {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(b"\n");
    }
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(value.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

fn frames(values: &[Value], named: bool) -> Vec<u8> {
    let mut out = Vec::new();
    for v in values {
        if named {
            named_frame(&mut out, v);
        } else {
            frame(&mut out, v);
        }
    }
    out
}

pub fn response<F: ChunkFormat>(generation: Generation, format: F) -> Response {
    let state = StreamState {
        generation,
        format,
        phase: Phase::Opening,
    };
    let body = stream::unfold(state, |mut st| async move {
        let bytes = match st.phase {
            Phase::Opening => {
                st.phase = Phase::Running;
                frames(&st.format.opening(), st.format.named_events())
            }
            Phase::Running => next_frames(&mut st).await,
            Phase::Ended => return None,
        };
        Some((Ok::<_, std::convert::Infallible>(Bytes::from(bytes)), st))
    });
    let mut response = Response::new(Body::from_stream(body));
    *response.status_mut() = StatusCode::OK;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Tells reverse proxies not to buffer the stream.
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

/// Frames for the next non-empty batch, or the stream's end.
async fn next_frames<F: ChunkFormat>(st: &mut StreamState<F>) -> Vec<u8> {
    loop {
        match st.generation.next().await {
            Some(Ok(batch)) => {
                let named = st.format.named_events();
                let mut out = frames(&st.format.batch(&batch), named);
                if let Some(summary) = &batch.done {
                    out.extend(frames(&st.format.closing(summary), named));
                    out.extend_from_slice(DONE);
                    st.phase = Phase::Ended;
                }
                if !out.is_empty() {
                    return out;
                }
            }
            Some(Err(e)) => {
                // Headers are long gone: the error travels as an event.
                metrics::counter!(crate::telemetry::metric::ERRORS, "kind" => e.label())
                    .increment(1);
                tracing::warn!(error = %e, "stream failed");
                let mut out = frames(&[e.body()], false);
                out.extend_from_slice(DONE);
                st.phase = Phase::Ended;
                return out;
            }
            None => {
                st.phase = Phase::Ended;
                return DONE.to_vec();
            }
        }
    }
}
