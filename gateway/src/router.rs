//! Per request: signals from the engines' loads and the KV pool, the policy's
//! decision, then the decision's chain tried in order until an engine
//! accepts (an engine that cannot serve the request, or is full, is
//! skipped). The accepted request comes back with a guard that cancels it
//! in the engine if the caller lets go early.

use std::sync::Arc;

use engine_core::{CancelToken, EngineError, EventStream, GenerateRequest, Refusal, RequestId};
use policies::{PolicyHandle, Signals};

use crate::host::{EngineEntry, FaultKind, Registry};
use crate::protocol::ApiError;
use crate::telemetry::metric;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    /// The request can never be served as given (too large for the pool,
    /// the context...).
    #[error("{0}")]
    Invalid(String),
    /// Every engine in the chain that could serve it is full.
    #[error("every engine able to serve the request is at capacity")]
    Overloaded,
    /// No engine in the chain can serve this kind of request.
    #[error("no engine on this request's route can serve it ({0})")]
    NoCapableEngine(String),
    /// The engines in the chain that could serve it are out of service
    /// after a fault (they come back once a probe succeeds).
    #[error("no engine on this request's route is in service; retry shortly")]
    NoHealthyEngine,
    #[error("{0}")]
    Internal(String),
}

impl From<RouteError> for ApiError {
    fn from(e: RouteError) -> Self {
        match e {
            RouteError::Invalid(message) => ApiError::invalid_no_param(message),
            RouteError::Overloaded => ApiError::Overloaded,
            e @ RouteError::NoCapableEngine(_) => ApiError::Unavailable(e.to_string()),
            e @ RouteError::NoHealthyEngine => ApiError::OutOfService(e.to_string()),
            RouteError::Internal(message) => ApiError::Engine(message),
        }
    }
}

/// Cancels the request in its engine when dropped while armed: a client
/// that disconnects (the response body is dropped) or times out stops its
/// generation at once, and the engine returns its KV blocks.
pub struct CancelGuard {
    entry: Arc<EngineEntry>,
    id: RequestId,
    token: CancelToken,
    armed: bool,
}

impl CancelGuard {
    /// The request finished on its own; nothing to cancel.
    pub fn disarm(&mut self) {
        self.armed = false;
    }

    /// The engine failed this request: it has ended; the fault is noted
    /// (and may take the engine out of routing).
    pub fn fault(&mut self, kind: FaultKind, reason: &str) {
        self.armed = false;
        self.entry.record_fault(kind, reason.to_owned());
    }

    /// Stops the request now (a stop string matched).
    pub fn cancel(&mut self) {
        if self.armed {
            self.token.cancel();
            self.entry.cancel(self.id);
            self.armed = false;
        }
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            tracing::info!(engine = %self.entry.name, request = %self.id, "client went away; cancelling its request");
            self.cancel();
        }
    }
}

/// An accepted request.
pub struct Routed {
    pub entry: Arc<EngineEntry>,
    pub rule: String,
    pub events: EventStream,
    pub guard: CancelGuard,
}

pub struct Router {
    registry: Arc<Registry>,
    policy: PolicyHandle,
}

impl Router {
    pub fn new(registry: Arc<Registry>, policy: PolicyHandle) -> Self {
        Self { registry, policy }
    }

    /// The routing policy, for showing it.
    pub fn policy(&self) -> &PolicyHandle {
        &self.policy
    }

    pub fn signals(&self, req: &GenerateRequest, model: &str) -> Signals {
        let mut s = Signals {
            prompt_tokens: req.prompt.len() as u64,
            max_tokens: req.max_tokens as u64,
            greedy: req.is_plain_greedy(),
            has_tools: req.has_tools,
            has_images: !req.images.is_empty(),
            kv_pressure: self.registry.shared.kv_pool.pressure(),
            model: model.to_owned(),
            ..Signals::default()
        };
        for entry in self.registry.engines() {
            let load = entry.load();
            s.total_active += load.active as u64;
            s.total_queued += load.queued as u64;
            s.engine_active
                .insert(entry.name.clone(), load.active as u64);
            s.engine_queued
                .insert(entry.name.clone(), load.queued as u64);
            if let Some(rate) = load.accept_rate {
                s.engine_accept_rate.insert(entry.name.clone(), rate as f64);
            }
            if let Some(speedup) = load.expected_speedup {
                s.engine_speedup.insert(entry.name.clone(), speedup as f64);
            }
        }
        s
    }

    /// `grammar_optional`: an engine that applies no grammars gets the
    /// request without its grammar instead of being skipped.
    pub fn route(
        &self,
        req: GenerateRequest,
        model: &str,
        grammar_optional: bool,
    ) -> Result<Routed, RouteError> {
        let signals = self.signals(&req, model);
        let policy = self.policy.active();
        let decision = policy.decide(&signals);
        let rule = decision.rule.to_owned();
        let mut busy = false;
        let mut out_of_service = false;
        let mut benched = false;
        let mut reasons: Vec<String> = Vec::new();
        for name in decision.chain() {
            // Not loaded (its plugin or drafter failed at startup).
            let Some(entry) = self.registry.get(name) else {
                out_of_service = true;
                self.count_fallback(name);
                continue;
            };
            let mut submitted = req.clone();
            if grammar_optional && !entry.capabilities.grammar {
                submitted.grammar = None;
            }
            if let Some(reason) = unsupported(entry, &submitted) {
                reasons.push(format!("{name}: {reason}"));
                self.count_fallback(name);
                continue;
            }
            // One that could serve it, benched after a fault: it comes back.
            if !entry.is_serving() {
                benched = true;
                self.count_fallback(name);
                continue;
            }
            let token = req.cancel.clone();
            let id = req.id;
            match entry.submit(submitted) {
                Ok(events) => {
                    metrics::counter!(metric::ROUTES, "engine" => entry.name.clone(), "rule" => rule.clone())
                        .increment(1);
                    tracing::debug!(engine = %entry.name, rule = %rule, request = %id, "routed");
                    let guard = CancelGuard {
                        entry: entry.clone(),
                        id,
                        token,
                        armed: true,
                    };
                    return Ok(Routed {
                        entry: entry.clone(),
                        rule,
                        events,
                        guard,
                    });
                }
                // Only refusals about the request itself reach the client;
                // the others may describe other clients' traffic.
                Err(EngineError::Refused(r @ (Refusal::NotPlainGreedy | Refusal::Tools))) => {
                    reasons.push(format!("{name}: {r}"));
                }
                Err(EngineError::Refused(r)) => {
                    tracing::debug!(engine = %name, reason = %r, "engine refused; trying the next");
                    busy = true;
                }
                Err(EngineError::Overloaded(_)) | Err(EngineError::ShuttingDown) => busy = true,
                Err(EngineError::Invalid(message)) => return Err(RouteError::Invalid(message)),
                Err(EngineError::Internal(message)) => {
                    tracing::error!(engine = %name, error = %message, "engine failed to accept a request");
                    return Err(RouteError::Internal(message));
                }
                // The details (a panic message) stay in the log.
                Err(EngineError::Failed(_)) => {
                    return Err(RouteError::Internal(format!(
                        "the engine `{name}` failed while accepting this request"
                    )));
                }
            }
            self.count_fallback(name);
        }
        if busy {
            Err(RouteError::Overloaded)
        } else if benched || (out_of_service && reasons.is_empty()) {
            Err(RouteError::NoHealthyEngine)
        } else {
            Err(RouteError::NoCapableEngine(reasons.join("; ")))
        }
    }

    fn count_fallback(&self, from: &str) {
        metrics::counter!(metric::ROUTE_FALLBACKS, "from" => from.to_owned()).increment(1);
    }
}

/// Why an engine cannot take this request, from its advertised capabilities.
fn unsupported(entry: &EngineEntry, req: &GenerateRequest) -> Option<&'static str> {
    if entry.capabilities.greedy_only && !req.is_plain_greedy() {
        return Some("it serves plain greedy requests only");
    }
    if req.has_tools && !entry.capabilities.tools {
        return Some("it does not serve requests with tools");
    }
    if !req.images.is_empty() && !entry.capabilities.images {
        return Some("it does not serve requests with images");
    }
    if req.grammar.is_some() && !entry.capabilities.grammar {
        return Some("it does not apply structured-output grammars");
    }
    None
}
