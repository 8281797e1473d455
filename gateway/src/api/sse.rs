//! Server-sent events for streamed completions: `data: {json}\n\n` frames,
//! ending with `data: [DONE]`; several choices' chunks interleaved, each
//! naming its choice by `index`. The body owns the `Generation`, so a client
//! that disconnects drops the body and thereby cancels the request in its
//! engine at once.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use futures_util::{stream, Stream, StreamExt};
use serde_json::Value;

use crate::generation::{Batch, Generation, Summary, Usage};

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

/// Chunk objects of one generation, as they come.
struct Piece {
    chunks: Vec<Value>,
    /// With the closing chunks.
    summary: Option<Summary>,
    /// The chunk is an error; nothing follows.
    failed: bool,
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
    frame(out, value);
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
    let named = format.named_events();
    // An error event is a plain frame, as on every endpoint.
    let body = pieces(generation, format)
        .map(move |piece| frames(&piece.chunks, named && !piece.failed))
        .chain(stream::once(async { DONE.to_vec() }));
    event_stream(body)
}

/// Several generations' chunks interleaved as they come (`n` > 1, prompt
/// lists), choice `i`'s chunks carrying `index: i`. `leads[i]`: choice `i`
/// is the first of its prompt (for [`Usage::merged`]); one usage chunk,
/// when asked for, closes the stream. An error in any choice ends the
/// stream (dropping the others cancels them).
pub fn response_choices<F: ChunkFormat>(
    choices: Vec<(Generation, F)>,
    leads: Vec<bool>,
) -> Response {
    let merged = stream::select_all(
        choices
            .into_iter()
            .enumerate()
            .map(|(i, (generation, format))| {
                pieces(generation, format).map(move |p| (i, p)).boxed()
            }),
    );
    let state = Interleave {
        leads,
        usages: Vec::new(),
        usage_chunk: None,
        ended: false,
    };
    let body = stream::unfold((merged, state), |(mut merged, mut st)| async move {
        while !st.ended {
            let out = match merged.next().await {
                Some((i, piece)) => st.piece(i, piece),
                None => st.close(),
            };
            if !out.is_empty() {
                return Some((out, (merged, st)));
            }
        }
        None
    });
    event_stream(body)
}

struct Interleave {
    leads: Vec<bool>,
    usages: Vec<(bool, Usage)>,
    /// A choice's own usage chunk: the merged one's template.
    usage_chunk: Option<Value>,
    ended: bool,
}

impl Interleave {
    fn piece(&mut self, i: usize, piece: Piece) -> Vec<u8> {
        let mut out = Vec::new();
        for mut chunk in piece.chunks {
            match chunk.get_mut("choices").and_then(Value::as_array_mut) {
                Some(choices) if choices.is_empty() => {
                    self.usage_chunk = Some(chunk);
                    continue;
                }
                Some(choices) => {
                    for c in choices {
                        c["index"] = i.into();
                    }
                }
                None => {}
            }
            frame(&mut out, &chunk);
        }
        if let Some(summary) = piece.summary {
            self.usages.push((self.leads[i], summary.usage));
        }
        if piece.failed {
            out.extend_from_slice(DONE);
            self.ended = true;
        }
        out
    }

    fn close(&mut self) -> Vec<u8> {
        self.ended = true;
        let mut out = Vec::new();
        if let Some(mut chunk) = self.usage_chunk.take() {
            chunk["usage"] = Usage::merged(self.usages.drain(..)).to_json();
            frame(&mut out, &chunk);
        }
        out.extend_from_slice(DONE);
        out
    }
}

fn event_stream(body: impl Stream<Item = Vec<u8>> + Send + 'static) -> Response {
    let body = body.map(|bytes| Ok::<_, std::convert::Infallible>(Bytes::from(bytes)));
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

/// One generation's chunks: the opening ones, each non-empty batch's, the
/// closing ones (or an error object), then nothing.
fn pieces<F: ChunkFormat>(generation: Generation, format: F) -> impl Stream<Item = Piece> + Send {
    let state = StreamState {
        generation,
        format,
        phase: Phase::Opening,
    };
    stream::unfold(state, |mut st| async move {
        let piece = match st.phase {
            Phase::Opening => {
                st.phase = Phase::Running;
                Piece {
                    chunks: st.format.opening(),
                    summary: None,
                    failed: false,
                }
            }
            Phase::Running => next_piece(&mut st).await?,
            Phase::Ended => return None,
        };
        Some((piece, st))
    })
}

/// The next non-empty batch's chunks, or the end.
async fn next_piece<F: ChunkFormat>(st: &mut StreamState<F>) -> Option<Piece> {
    loop {
        match st.generation.next().await {
            Some(Ok(batch)) => {
                let mut chunks = st.format.batch(&batch);
                if let Some(summary) = &batch.done {
                    chunks.extend(st.format.closing(summary));
                    st.phase = Phase::Ended;
                }
                if !chunks.is_empty() || batch.done.is_some() {
                    return Some(Piece {
                        chunks,
                        summary: batch.done,
                        failed: false,
                    });
                }
            }
            Some(Err(e)) => {
                // Headers are long gone: the error travels as an event.
                metrics::counter!(crate::telemetry::metric::ERRORS, "kind" => e.label())
                    .increment(1);
                tracing::warn!(error = %e, "stream failed");
                st.phase = Phase::Ended;
                return Some(Piece {
                    chunks: vec![e.body()],
                    summary: None,
                    failed: true,
                });
            }
            None => {
                st.phase = Phase::Ended;
                return None;
            }
        }
    }
}
