//! Per request: signals from the engines' loads and the KV pool, the policy's
//! decision among the engines whose declared capabilities accept the
//! request (`engine_core::Capabilities::accepts`, the one rule: a rule
//! routing to an engine that cannot take it is passed over), then the
//! decision's chain tried in order until an engine takes it (one that
//! cannot, or is full, is skipped). The accepted request comes back with a
//! guard that cancels it in the engine if the caller lets go early.
//!
//! Exclusive engines are kept alone here: the router counts the requests
//! it placed whose streams have not ended (a sequence handed from one
//! engine to another keeps its stream, so it counts throughout), and
//! decides and submits under the lock of that count, so two arrivals
//! cannot both find the server idle.

use std::sync::{Arc, Mutex, MutexGuard};

use engine_core::{CancelToken, EngineError, EventStream, GenerateRequest, RequestId, Unsupported};
use policies::{PolicyHandle, Signals};
use runtime::KvPool;

use crate::host::{self, EngineEntry, FaultKind, Registry};
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

/// Requests placed whose streams have not ended, on every engine.
#[derive(Clone, Default)]
struct InFlight(Arc<Mutex<usize>>);

impl InFlight {
    fn lock(&self) -> MutexGuard<'_, usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Cancels the request in its engine when dropped while armed: a client
/// that disconnects (the response body is dropped) or times out stops its
/// generation at once, and the engine returns its KV blocks. The request
/// stops counting as in flight when it ends (its final event arrived, it
/// was stopped, or its client left), before the client has its answer.
pub struct CancelGuard {
    entry: Arc<EngineEntry>,
    id: RequestId,
    token: CancelToken,
    armed: bool,
    in_flight: Option<InFlight>,
}

impl CancelGuard {
    /// The request finished on its own; nothing to cancel.
    pub fn disarm(&mut self) {
        self.armed = false;
        self.ended();
    }

    /// The engine failed this request: it has ended; the fault is noted
    /// (and may take the engine out of routing).
    pub fn fault(&mut self, kind: FaultKind, reason: &str) {
        self.disarm();
        self.entry.record_fault(kind, reason.to_owned());
    }

    /// Stops the request now (a stop string matched).
    pub fn cancel(&mut self) {
        if self.armed {
            self.token.cancel();
            self.entry.cancel(self.id);
        }
        self.disarm();
    }

    fn ended(&mut self) {
        if let Some(in_flight) = self.in_flight.take() {
            *in_flight.lock() -= 1;
        }
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            tracing::info!(engine = %self.entry.name, request = %self.id, "client went away; cancelling its request");
        }
        self.cancel();
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
    engines: Vec<Arc<EngineEntry>>,
    kv_pool: KvPool,
    policy: PolicyHandle,
    in_flight: InFlight,
}

impl Router {
    pub fn new(registry: Arc<Registry>, policy: PolicyHandle) -> Self {
        Self::over(
            registry.engines().to_vec(),
            registry.shared.kv_pool.clone(),
            policy,
        )
    }

    /// A router over these engines, whose KV blocks come from `kv_pool`.
    fn over(engines: Vec<Arc<EngineEntry>>, kv_pool: KvPool, policy: PolicyHandle) -> Self {
        Self {
            engines,
            kv_pool,
            policy,
            in_flight: InFlight::default(),
        }
    }

    fn get(&self, name: &str) -> Option<&Arc<EngineEntry>> {
        self.engines.iter().find(|e| e.name == name)
    }

    /// The routing policy, for showing it.
    pub fn policy(&self) -> &PolicyHandle {
        &self.policy
    }

    pub fn signals(&self, req: &GenerateRequest, model: &str) -> Signals {
        // The policy reads the facts the capabilities are checked against.
        let needs = req.needs(0);
        let mut s = Signals {
            prompt_tokens: req.prompt.len() as u64,
            max_tokens: req.max_tokens as u64,
            greedy: needs.plain_greedy,
            has_tools: needs.tools,
            has_images: needs.images,
            kv_pressure: self.kv_pool.pressure(),
            model: model.to_owned(),
            ..Signals::default()
        };
        for entry in &self.engines {
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
        // Held until the request is placed: an exclusive engine is chosen
        // only while nothing is in flight, and nothing else is placed
        // before it has its request.
        let mut in_flight = self.in_flight.lock();
        let signals = self.signals(&req, model);
        let mut needs = req.needs(*in_flight);
        // An engine that applies no grammars gets the request without it.
        needs.grammar &= !grammar_optional;
        let policy = self.policy.active();
        let decision =
            policy.decide_where(&signals, |name| host::takes(&self.engines, name, &needs));
        let rule = decision.rule.to_owned();
        let mut busy = false;
        let mut out_of_service = false;
        let mut benched = false;
        let mut reasons: Vec<String> = Vec::new();
        for name in decision.chain() {
            // Not loaded (its plugin or drafter failed at startup).
            let Some(entry) = self.get(name) else {
                out_of_service = true;
                self.count_fallback(name);
                continue;
            };
            match entry.capabilities.accepts(&needs) {
                Ok(()) => {}
                // Busy for now, not unable.
                Err(Unsupported::NotAlone) => {
                    busy = true;
                    self.count_fallback(name);
                    continue;
                }
                Err(reason) => {
                    reasons.push(format!("{name}: {reason}"));
                    self.count_fallback(name);
                    continue;
                }
            }
            // One that could serve it, benched after a fault: it comes back.
            if !entry.is_serving() {
                benched = true;
                self.count_fallback(name);
                continue;
            }
            let mut submitted = req.clone();
            if grammar_optional && !entry.capabilities.grammar {
                submitted.grammar = None;
            }
            let token = req.cancel.clone();
            let id = req.id;
            match entry.submit(submitted) {
                Ok(events) => {
                    metrics::counter!(metric::ROUTES, "engine" => entry.name.clone(), "rule" => rule.clone())
                        .increment(1);
                    tracing::debug!(engine = %entry.name, rule = %rule, request = %id, "routed");
                    *in_flight += 1;
                    let guard = CancelGuard {
                        entry: entry.clone(),
                        id,
                        token,
                        armed: true,
                        in_flight: Some(self.in_flight.clone()),
                    };
                    return Ok(Routed {
                        entry: entry.clone(),
                        rule,
                        events,
                        guard,
                    });
                }
                // Refusals describe the engine's state (and may describe
                // other clients' traffic): the client hears only "busy".
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

#[cfg(test)]
mod tests {
    //! The router over engines that only record what reaches them: which
    //! engine may take a request is decided here, from declared
    //! capabilities and the router's own count of requests in flight.

    use std::sync::Barrier;

    use engine_core::{Capabilities, Engine, EngineLoad, EventSender, Grammar};
    use policies::Policy;

    use super::*;

    /// Takes every request and keeps its stream open; its load reads idle,
    /// so only the router's own count can keep an exclusive engine alone.
    struct Recorder {
        name: String,
        capabilities: Capabilities,
        open: Mutex<Vec<EventSender>>,
    }

    impl Engine for Recorder {
        fn name(&self) -> &str {
            &self.name
        }
        fn capabilities(&self) -> Capabilities {
            self.capabilities.clone()
        }
        fn submit_to(&self, _: GenerateRequest, events: EventSender) -> Result<(), EngineError> {
            self.open.lock().unwrap().push(events);
            Ok(())
        }
        fn cancel(&self, _: RequestId) {}
        fn load(&self) -> EngineLoad {
            EngineLoad {
                healthy: true,
                ..EngineLoad::default()
            }
        }
        fn shutdown(&self) {}
    }

    fn engine(name: &str, capabilities: Capabilities) -> Arc<EngineEntry> {
        let recorder = Recorder {
            name: name.into(),
            capabilities,
            open: Mutex::new(Vec::new()),
        };
        Arc::new(EngineEntry::new(
            name.into(),
            name.into(),
            Box::new(recorder),
        ))
    }

    /// `fast`: plain greedy, alone (the fast path); `spec`: tools and
    /// grammars, no images or logprobs (a speculative engine); `batched`:
    /// everything.
    fn router(policy: &str) -> Router {
        let engines = vec![
            engine(
                "fast",
                Capabilities {
                    greedy_only: true,
                    grammar: true,
                    exclusive: true,
                    ..Capabilities::default()
                },
            ),
            engine(
                "spec",
                Capabilities {
                    tools: true,
                    grammar: true,
                    ..Capabilities::default()
                },
            ),
            engine(
                "batched",
                Capabilities {
                    tools: true,
                    images: true,
                    grammar: true,
                    logprobs: true,
                    ..Capabilities::default()
                },
            ),
        ];
        let names = ["fast", "spec", "batched"];
        let policy = Policy::from_yaml(policy, &names).unwrap();
        let handle = PolicyHandle::new(policy, serde_yaml::Value::Null, &names);
        Router::over(engines, KvPool::new(64, 16, 1024), handle)
    }

    const GREEDY_TO_FAST: &str = "policy:
  default: batched
  rules:
    - { name: to-fast, when: { greedy: true }, route: fast }
    - { name: to-spec, when: { prompt_tokens: { gte: 1 } }, route: spec }
";

    fn greedy() -> GenerateRequest {
        GenerateRequest::new(vec![1, 2, 3], 4)
    }

    fn placed(r: &Router, req: GenerateRequest) -> (String, String, Routed) {
        let routed = r.route(req, "m", false).unwrap();
        (routed.entry.name.clone(), routed.rule.clone(), routed)
    }

    fn place(r: &Router, req: GenerateRequest) -> (String, String) {
        let (engine, rule, _) = placed(r, req);
        (engine, rule)
    }

    #[test]
    fn a_rule_whose_engine_cannot_take_the_request_is_passed_over() {
        let r = router(GREEDY_TO_FAST);
        let pair = |e: &str, rule: &str| (e.to_owned(), rule.to_owned());
        assert_eq!(place(&r, greedy()), pair("fast", "to-fast"));
        let mut tools = greedy();
        tools.has_tools = true;
        assert_eq!(place(&r, tools), pair("spec", "to-spec"));
        let mut logprobs = greedy();
        logprobs.sampling.temperature = 0.5;
        logprobs.sampling.logprobs = true;
        assert_eq!(place(&r, logprobs), pair("batched", "default"));
        let mut grammar = greedy();
        grammar.sampling.temperature = 0.5;
        grammar.grammar = Some(Grammar::Regex("a+".into()));
        assert_eq!(place(&r, grammar), pair("spec", "to-spec"));

        // Nothing on the chain takes it: the reason names what is missing.
        let r = router("policy:\n  default: fast\n  fallback: [spec]\n");
        let mut images = greedy();
        images.sampling.temperature = 0.5;
        images.images.push(engine_core::ImageInput {
            start: 0,
            tokens: 1,
            width: 1,
            embeddings: Default::default(),
            bidirectional: false,
        });
        let Err(RouteError::NoCapableEngine(why)) = r.route(images, "m", false) else {
            panic!("routed a request nothing can take");
        };
        assert_eq!(
            why,
            "fast: it serves plain greedy requests only; spec: it does not serve requests with images"
        );
    }

    #[test]
    fn concurrent_arrivals_give_the_exclusive_engine_exactly_one() {
        let r = router(GREEDY_TO_FAST);
        let arrivals = 8;
        let barrier = Barrier::new(arrivals);
        let routed: Vec<(String, String, Routed)> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..arrivals)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        placed(&r, greedy())
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let on_fast = routed.iter().filter(|(e, _, _)| e == "fast").count();
        assert_eq!(
            on_fast,
            1,
            "{:?}",
            routed.iter().map(|(e, _, _)| e).collect::<Vec<_>>()
        );
        // The others passed the fast path over and went down the rules.
        assert!(routed
            .iter()
            .all(|(e, rule, _)| e == "fast" || (e == "spec" && rule == "to-spec")));
        drop(routed);
        assert_eq!(place(&r, greedy()).0, "fast", "all ended: alone again");
    }

    #[test]
    fn arrivals_during_an_exclusive_run_go_elsewhere_until_all_end() {
        let r = router(GREEDY_TO_FAST);
        let (engine, _, mut alone) = placed(&r, greedy());
        assert_eq!(engine, "fast");
        // While it runs (or after it handed its sequence over: its stream
        // goes on, so it still counts), a newcomer goes elsewhere.
        let (engine, _, mut beside) = placed(&r, greedy());
        assert_eq!(engine, "spec");
        // Its final event ends it; the other still runs.
        alone.guard.disarm();
        assert_eq!(place(&r, greedy()).0, "spec");
        // A request stopped by a stop string ends too.
        beside.guard.cancel();
        assert_eq!(place(&r, greedy()).0, "fast");

        // Where the exclusive engine is the only way, the request waits
        // its turn (busy), rather than being told it cannot be served.
        let r = router("policy:\n  default: fast\n");
        let _running = placed(&r, greedy());
        assert_eq!(
            r.route(greedy(), "m", false).err(),
            Some(RouteError::Overloaded)
        );
    }
}
