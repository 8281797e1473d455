//! Fault tracking around a plugin engine. Panics are caught inside the
//! plugin (engine_core's panic barrier: one std cannot catch another's
//! panic) and come back as `EngineError::Failed` plus `healthy: false`.
//! Here the host notes an engine's own faults and takes it out of routing:
//! a panic or a request stream dropped without its final event benches it
//! until it proves it serves again (the host's probe, [`super::probe`],
//! sends it a one-token request now and then); an internal error while
//! accepting a request benches it for [`ERROR_COOLDOWN`]. An `Error` event
//! fails only its request (an upstream that died mid-stream, a step out of
//! memory, are not the engine's fault) and is counted.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine_core::{
    Capabilities, Engine, EngineError, EngineLoad, Event, EventStream, GenerateRequest, Needs,
    RequestId,
};

use crate::telemetry::metric;
/// How long an engine that reported an error is left out of routing.
pub const ERROR_COOLDOWN: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// A call into the plugin panicked.
    Panic,
    /// A request's event stream ended without `Finished` or `Error`
    /// (the engine's worker died).
    LostStream,
    /// The engine could not accept a request (an internal error).
    Error,
    /// One request failed (an `Error` event); the engine keeps serving.
    RequestError,
}

impl FaultKind {
    pub fn label(self) -> &'static str {
        match self {
            FaultKind::Panic => "panic",
            FaultKind::LostStream => "lost_stream",
            FaultKind::Error => "error",
            FaultKind::RequestError => "request_error",
        }
    }

    /// Lasts until a probe request succeeds (rather than a cooldown).
    fn is_permanent(self) -> bool {
        matches!(self, FaultKind::Panic | FaultKind::LostStream)
    }
}

#[derive(Debug, Clone)]
pub struct Fault {
    pub kind: FaultKind,
    pub reason: String,
    pub at: Instant,
}

impl Fault {
    /// Still keeping the engine out of routing.
    fn is_active(&self) -> bool {
        self.kind.is_permanent() || self.at.elapsed() < ERROR_COOLDOWN
    }
}

/// Whether the engine `name` among `engines` may take a request with
/// `needs`, by its declared capabilities: what the router and `gateway
/// policy` ask before a rule may route there. One that is not loaded is
/// left to the route's chain, which reports it out of service.
pub fn takes(engines: &[Arc<EngineEntry>], name: &str, needs: &Needs) -> bool {
    engines
        .iter()
        .find(|e| e.name == name)
        .is_none_or(|e| e.capabilities.accepts(needs).is_ok())
}

/// A loaded engine and what the router needs to know about it.
pub struct EngineEntry {
    pub name: String,
    pub kind: String,
    pub capabilities: Capabilities,
    engine: Box<dyn Engine>,
    fault: Mutex<Option<Fault>>,
}

impl EngineEntry {
    pub fn new(name: String, kind: String, engine: Box<dyn Engine>) -> Self {
        let capabilities = engine.capabilities();
        Self {
            name,
            kind,
            capabilities,
            engine,
            fault: Mutex::new(None),
        }
    }

    /// Schedules the request; an engine that fails here is taken out of
    /// routing.
    pub fn submit(&self, req: GenerateRequest) -> Result<EventStream, EngineError> {
        let result = self.engine.submit(req);
        match &result {
            Err(EngineError::Failed(reason)) => self.record_fault(FaultKind::Panic, reason.clone()),
            Err(EngineError::Internal(reason)) => {
                self.record_fault(FaultKind::Error, reason.clone())
            }
            _ => {}
        }
        result
    }

    pub fn cancel(&self, id: RequestId) {
        self.engine.cancel(id);
    }

    /// The engine's load; `healthy` is false while a fault is active.
    pub fn load(&self) -> EngineLoad {
        let mut load = self.engine.load();
        load.healthy &= self.active_fault().is_none();
        load
    }

    pub fn shutdown(&self) {
        self.engine.shutdown();
    }

    /// Whether the router may send this engine work.
    pub fn is_serving(&self) -> bool {
        self.load().healthy
    }

    /// The fault keeping the engine out of routing, if any.
    pub fn active_fault(&self) -> Option<Fault> {
        let fault = self.fault.lock().unwrap_or_else(|p| p.into_inner());
        fault.as_ref().filter(|f| f.is_active()).cloned()
    }

    /// Whether the engine is out of routing until a probe succeeds.
    pub fn needs_probe(&self) -> bool {
        self.active_fault().is_some_and(|f| f.kind.is_permanent())
    }

    /// Sends the engine a one-token greedy request of its own (no client,
    /// no accounting); when it finishes within `timeout`, the fault is
    /// cleared and the engine routes again.
    pub async fn probe(&self, timeout: Duration) -> bool {
        let request = GenerateRequest::new(vec![0], 1);
        let cancel = request.cancel.clone();
        let Ok(mut stream) = self.engine.submit(request) else {
            return false;
        };
        let finished = tokio::time::timeout(timeout, async {
            while let Some(event) = stream.recv().await {
                match event {
                    Event::Finished(_) => return true,
                    Event::Error(_) => return false,
                    Event::Token(_) => {}
                }
            }
            false
        })
        .await
        .unwrap_or(false);
        cancel.cancel();
        if finished {
            tracing::info!(engine = %self.name, "engine served a probe request; back in routing");
            *self.fault.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        finished
    }

    pub fn record_fault(&self, kind: FaultKind, reason: String) {
        metrics::counter!(metric::ENGINE_FAULTS, "engine" => self.name.clone(), "kind" => kind.label())
            .increment(1);
        if kind == FaultKind::RequestError {
            tracing::warn!(engine = %self.name, %reason, "a request failed in its engine");
            return;
        }
        tracing::error!(engine = %self.name, fault = kind.label(), %reason, "engine fault; taking it out of routing");
        let mut fault = self.fault.lock().unwrap_or_else(|p| p.into_inner());
        // A permanent fault is never downgraded by a later error.
        if fault.as_ref().is_some_and(|f| f.kind.is_permanent()) {
            return;
        }
        *fault = Some(Fault {
            kind,
            reason,
            at: Instant::now(),
        });
    }
}
