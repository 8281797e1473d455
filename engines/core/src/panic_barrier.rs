//! Panics stay inside the plugin that raised them. Each `cdylib` links its
//! own copy of std, and one copy cannot catch another's panic (it aborts
//! the process), so the barrier must be compiled into the plugin: the
//! [`export_engine!`](crate::export_engine) entry point wraps the
//! constructor and the engine it builds. A panicking call fails only the
//! request at hand, and the engine then reports itself unhealthy for good
//! (its state can no longer be trusted) so the host routes around it.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use crate::engine::{Capabilities, Engine, EngineError, EngineLoad};
use crate::event::EventSender;
use crate::plugin::EngineContext;
use crate::request::{GenerateRequest, RequestId};

/// Builds the engine with `constructor`, panics turned into errors.
pub fn guarded_create(
    ctx: EngineContext,
    constructor: fn(EngineContext) -> Result<Box<dyn Engine>, String>,
) -> Result<Box<dyn Engine>, String> {
    match catch_unwind(AssertUnwindSafe(|| constructor(ctx))) {
        Ok(Ok(engine)) => Ok(Box::new(PanicBarrier {
            inner: engine,
            panicked: Mutex::new(None),
        })),
        Ok(Err(e)) => Err(e),
        Err(panic) => Err(format!(
            "the engine constructor panicked: {}",
            panic_message(&*panic)
        )),
    }
}

/// The text of a panic payload.
pub fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

struct PanicBarrier {
    inner: Box<dyn Engine>,
    /// What the first panic said; the engine is unhealthy from then on.
    panicked: Mutex<Option<String>>,
}

impl PanicBarrier {
    fn guard<T>(&self, call: &str, f: impl FnOnce() -> T) -> Result<T, String> {
        catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
            let message = format!("panicked in {call}: {}", panic_message(&*panic));
            tracing::error!(engine = %self.inner.name(), %message, "engine panicked; it is out of service");
            let mut first = self.panicked.lock().unwrap_or_else(|p| p.into_inner());
            first.get_or_insert_with(|| message.clone());
            message
        })
    }

    fn has_panicked(&self) -> bool {
        self.panicked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }
}

impl Engine for PanicBarrier {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.guard("capabilities", || self.inner.capabilities())
            .unwrap_or_default()
    }

    fn submit_to(&self, req: GenerateRequest, events: EventSender) -> Result<(), EngineError> {
        if self.has_panicked() {
            return Err(EngineError::Failed(
                "the engine is out of service after a panic".into(),
            ));
        }
        self.guard("submit", || self.inner.submit_to(req, events))
            .unwrap_or_else(|message| Err(EngineError::Failed(message)))
    }

    fn cancel(&self, id: RequestId) {
        let _ = self.guard("cancel", || self.inner.cancel(id));
    }

    fn load(&self) -> EngineLoad {
        let mut load = self.guard("load", || self.inner.load()).unwrap_or_default();
        load.healthy &= !self.has_panicked();
        load
    }

    fn shutdown(&self) {
        let _ = self.guard("shutdown", || self.inner.shutdown());
    }
}
