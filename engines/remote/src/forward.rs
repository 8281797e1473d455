//! One request's trip through the pool: pick an upstream, stream its
//! completion back as token events, and on failure before the first token
//! try another. After the first token a failure ends the request with an
//! error: retrying then would repeat tokens the client already has.

use std::sync::Arc;
use std::time::Duration;

use engine_core::event::EventSender;
use engine_core::{Event, Finish, FinishReason, GenerateRequest, StreamError, TokenEvent};
use http_body_util::BodyExt;
use hyper::StatusCode;
use tokio::sync::Notify;

use crate::client::{read_small, HttpClient};
use crate::config::Protocol;
use crate::pool::{Lease, Pick, Pool};
use crate::wire::{self, WirePrompt};
use sse::{SseDecoder, SseEvent};

pub struct Forwarder {
    pub pool: Arc<Pool>,
    pub client: HttpClient,
    pub tokenizer: Arc<text::Tokenizer>,
    /// The gateway's model name, sent when an upstream's own id is unknown.
    pub model: String,
    pub retries: usize,
    pub first_token_timeout: Duration,
    pub idle_timeout: Duration,
}

/// How one attempt on one upstream ended.
enum Attempt {
    Finished,
    Cancelled,
    /// Nothing reached the client yet: another upstream may serve it.
    Retryable {
        reason: String,
        upstream_down: bool,
        /// The upstream answered that it is at capacity (429, 503).
        busy: bool,
    },
    /// Final: the upstream rejected the request itself, or failed after
    /// tokens were delivered.
    Failed(StreamError),
}

/// Tokens delivered so far for a request, across attempts (only the last
/// attempt ever delivers any).
struct Delivery {
    events: EventSender,
    delivered: u32,
    cached_tokens: u32,
}

impl Forwarder {
    pub async fn run(&self, request: GenerateRequest, events: EventSender, cancel: Arc<Notify>) {
        let mut delivery = Delivery {
            events,
            delivered: 0,
            cached_tokens: 0,
        };
        let mut tried = Vec::new();
        let mut last_failure = String::from("no healthy upstream");
        // Upstreams at their limit: capacity, worth retrying later.
        let mut overloaded = false;
        for _ in 0..=self.retries {
            if request.cancel.is_cancelled() {
                self.finish(&request, &mut delivery, FinishReason::Cancelled);
                return;
            }
            let lease = match self.pool.pick(&request.prompt, &tried) {
                Pick::Leased(lease) => lease,
                Pick::AllBusy => {
                    last_failure = "every upstream is at its in-flight limit".into();
                    overloaded = true;
                    break;
                }
                Pick::NoneHealthy => break,
            };
            tried.push(lease.upstream.index);
            match self.attempt(&lease, &request, &mut delivery, &cancel).await {
                Attempt::Finished => return,
                Attempt::Cancelled => {
                    self.finish(&request, &mut delivery, FinishReason::Cancelled);
                    return;
                }
                Attempt::Retryable {
                    reason,
                    upstream_down,
                    busy,
                } => {
                    overloaded |= busy;
                    let upstream = &lease.upstream;
                    if upstream_down {
                        let previous = upstream.mark_down(reason.clone());
                        crate::health::log_change(upstream, &previous, &upstream.health());
                    }
                    tracing::warn!(request = %request.id, upstream = %upstream.url, %reason, "upstream failed before its first token; trying another");
                    last_failure = reason;
                }
                Attempt::Failed(error) => {
                    let _ = delivery.events.send(Event::Error(error));
                    return;
                }
            }
        }
        // Says nothing about other requests: only this one's attempts.
        let message = format!(
            "the remote pool could not serve the request after {} attempt(s): {last_failure}",
            tried.len()
        );
        let _ = delivery.events.send(Event::Error(if overloaded {
            StreamError::Overloaded(message)
        } else {
            StreamError::Internal(message)
        }));
    }

    fn finish(&self, request: &GenerateRequest, delivery: &mut Delivery, reason: FinishReason) {
        let _ = delivery.events.send(Event::Finished(Finish {
            reason,
            prompt_tokens: request.prompt.len() as u32,
            completion_tokens: delivery.delivered,
            cached_tokens: delivery.cached_tokens,
            spec: None,
        }));
    }

    async fn attempt(
        &self,
        lease: &Lease,
        request: &GenerateRequest,
        delivery: &mut Delivery,
        cancel: &Notify,
    ) -> Attempt {
        let upstream = &lease.upstream;
        let model = upstream
            .model
            .clone()
            .or_else(|| upstream.served_model())
            .unwrap_or_else(|| self.model.clone());
        let prompt_text;
        let prompt = match upstream.protocol {
            Protocol::TokenIds => WirePrompt::Ids(&request.prompt),
            Protocol::Text => {
                // Special tokens stay as text so the upstream re-encodes
                // them as the same specials.
                prompt_text = match self.tokenizer.decode(&request.prompt, false) {
                    Ok(t) => t,
                    Err(e) => {
                        return Attempt::Failed(StreamError::Invalid(format!(
                            "cannot decode the prompt: {e}"
                        )))
                    }
                };
                WirePrompt::Text(&prompt_text)
            }
        };
        let body = wire::completion_body(request, &model, prompt);
        let started = tokio::time::Instant::now();
        let first_token_deadline = started + self.first_token_timeout;
        let sent = self
            .client
            .post_json(upstream.url.endpoint("/v1/completions"), &body);
        let response = tokio::select! {
            r = tokio::time::timeout_at(first_token_deadline, sent) => match r {
                Ok(Ok(response)) => response,
                Ok(Err(e)) => return Attempt::Retryable { reason: e.message, upstream_down: e.connect, busy: false },
                Err(_) => return Attempt::Retryable { reason: "no response before the first-token timeout".into(), upstream_down: false, busy: false },
            },
            _ = cancel.notified() => return Attempt::Cancelled,
            _ = delivery.events.closed() => return Attempt::Cancelled,
        };
        let status = response.status();
        if !status.is_success() {
            let text = read_small(response.into_body()).await.unwrap_or_default();
            let message = error_text(&text);
            return if status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
                Attempt::Retryable {
                    reason: format!("upstream answered {status}: {message}"),
                    upstream_down: false,
                    busy: status == StatusCode::TOO_MANY_REQUESTS
                        || status == StatusCode::SERVICE_UNAVAILABLE,
                }
            } else {
                Attempt::Failed(StreamError::Invalid(format!(
                    "the upstream rejected the request ({status}): {message}"
                )))
            };
        }
        let mut body = response.into_body();
        let mut sse = SseDecoder::new();
        let mut stream = UpstreamStream::new(request, upstream.protocol, &self.tokenizer);
        loop {
            let deadline = if delivery.delivered == 0 {
                first_token_deadline
            } else {
                tokio::time::Instant::now() + self.idle_timeout
            };
            let frame = tokio::select! {
                f = tokio::time::timeout_at(deadline, body.frame()) => f,
                _ = cancel.notified() => return Attempt::Cancelled,
            };
            let failure = match frame {
                Ok(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    match stream.feed(sse.push(&data), delivery) {
                        Fed::More => continue,
                        Fed::Done => return Attempt::Finished,
                        Fed::ClientGone => return Attempt::Cancelled,
                        Fed::Failed(message) => message,
                    }
                }
                Ok(Some(Err(e))) => format!("the upstream stream broke: {e}"),
                Ok(None) => match stream.end(delivery) {
                    Fed::Done => return Attempt::Finished,
                    _ => "the upstream closed the stream before finishing".to_owned(),
                },
                Err(_) if delivery.delivered == 0 => {
                    "no token before the first-token timeout".to_owned()
                }
                Err(_) => "the upstream went silent past the idle timeout".to_owned(),
            };
            // Dropping the body here drops the connection with it.
            return if delivery.delivered == 0 {
                Attempt::Retryable {
                    reason: failure,
                    upstream_down: false,
                    busy: false,
                }
            } else {
                tracing::warn!(request = %request.id, upstream = %upstream.url, reason = %failure, "upstream failed mid-stream");
                Attempt::Failed(StreamError::Interrupted(format!(
                    "the upstream failed after the response started: {failure}"
                )))
            };
        }
    }
}

fn error_text(body: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(body) {
        Ok(v) => v
            .get("error")
            .map(wire::error_message)
            .unwrap_or_else(|| v.to_string()),
        Err(_) => body.chars().take(200).collect(),
    }
}

enum Fed {
    More,
    Done,
    ClientGone,
    Failed(String),
}

/// Turns one upstream's parsed chunks into token events for the client,
/// ending at a stop token, at `max_tokens`, or at the upstream's end.
struct UpstreamStream<'a> {
    request: &'a GenerateRequest,
    protocol: Protocol,
    tokenizer: &'a text::Tokenizer,
    finish: Option<FinishReason>,
    ended: bool,
}

impl<'a> UpstreamStream<'a> {
    fn new(
        request: &'a GenerateRequest,
        protocol: Protocol,
        tokenizer: &'a text::Tokenizer,
    ) -> Self {
        Self {
            request,
            protocol,
            tokenizer,
            finish: None,
            ended: false,
        }
    }

    fn feed(&mut self, events: Vec<SseEvent>, delivery: &mut Delivery) -> Fed {
        for event in events {
            let data = match event {
                SseEvent::Done => return self.end(delivery),
                SseEvent::Data(data) => data,
            };
            if self.ended {
                continue;
            }
            let chunk = match wire::parse_chunk(&data, self.protocol) {
                Ok(c) => c,
                Err(e) => return Fed::Failed(e.to_string()),
            };
            if let Some(cached) = chunk.cached_tokens {
                delivery.cached_tokens = cached;
            }
            let ids = match self.protocol {
                Protocol::TokenIds => chunk.token_ids,
                Protocol::Text if chunk.text.is_empty() => Vec::new(),
                Protocol::Text => match self.tokenizer.encode(&chunk.text, false) {
                    Ok(ids) => ids,
                    Err(e) => return Fed::Failed(format!("cannot re-tokenize upstream text: {e}")),
                },
            };
            for (i, id) in ids.into_iter().enumerate() {
                if self.request.stop_tokens.contains(&id) {
                    self.stop(FinishReason::Stop);
                    break;
                }
                let token = TokenEvent {
                    id,
                    logprob: chunk.logprobs.get(i).copied().flatten(),
                    top_logprobs: Vec::new(),
                };
                if delivery.events.send(Event::Token(token)).is_err() {
                    return Fed::ClientGone;
                }
                delivery.delivered += 1;
                if delivery.delivered >= self.request.max_tokens {
                    self.stop(FinishReason::Length);
                    break;
                }
            }
            if let Some(reason) = chunk.finish {
                self.stop(reason);
            }
        }
        Fed::More
    }

    /// The first reason wins: a stop token or the length cap seen here
    /// outranks what the upstream says later.
    fn stop(&mut self, reason: FinishReason) {
        if !self.ended {
            self.finish = Some(reason);
            self.ended = true;
        }
    }

    /// The upstream's stream is over (`[DONE]` or end of body).
    fn end(&mut self, delivery: &mut Delivery) -> Fed {
        let Some(reason) = self.finish else {
            return Fed::Failed("the upstream ended the stream without a finish reason".into());
        };
        let _ = delivery.events.send(Event::Finished(Finish {
            reason,
            prompt_tokens: self.request.prompt.len() as u32,
            completion_tokens: delivery.delivered,
            cached_tokens: delivery.cached_tokens,
            spec: None,
        }));
        Fed::Done
    }
}
