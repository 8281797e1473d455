//! The plugin's side: a Rust [`Engine`] behind the C function table. Every
//! function catches panics (none may unwind into the host) and owns the
//! handles it is given.

use std::panic::{catch_unwind, AssertUnwindSafe};

use serde::{Deserialize, Serialize};

use super::abi::{
    ByteSink, Bytes, EngineHandle, HostServices, PluginVTable, RawCancel, RawEventSink, RawRequest,
};
use super::wire::read_request;
use super::{log, EngineContext, ModelFacts, SharedHandle};
use crate::engine::{Engine, EngineError};
use crate::event::EventSender;
use crate::panic_barrier::{guarded_create, panic_message};
use crate::request::{CancelToken, RequestId};

pub type Constructor = fn(EngineContext) -> Result<Box<dyn Engine>, String>;

/// What `create` receives as JSON.
#[derive(Debug, Serialize, Deserialize)]
pub struct CreateArgs {
    pub name: String,
    /// The engine's section of config.yaml, as YAML.
    pub config_yaml: String,
    pub config_dir: std::path::PathBuf,
    #[serde(default)]
    pub model: Option<ModelFacts>,
}

/// The function table around `create` (the macro's per-plugin constructor
/// trampoline).
pub const fn vtable(
    create: unsafe extern "C" fn(Bytes, *const HostServices, *mut EngineHandle, ByteSink) -> bool,
) -> PluginVTable {
    PluginVTable {
        size: std::mem::size_of::<PluginVTable>(),
        create,
        submit,
        cancel,
        capabilities,
        load,
        shutdown,
        destroy,
    }
}

/// # Safety
/// The engine handle came from [`create`] and was not destroyed.
unsafe fn engine<'a>(handle: EngineHandle) -> &'a dyn Engine {
    &**(handle as *const Box<dyn Engine>)
}

fn json_or_empty<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

/// Builds an engine with `constructor`.
///
/// # Safety
/// Called by the host through the table, with valid arguments.
pub unsafe fn create(
    args: Bytes,
    host: *const HostServices,
    out: *mut EngineHandle,
    error: ByteSink,
    constructor: Constructor,
) -> bool {
    let built = catch_unwind(AssertUnwindSafe(|| -> Result<Box<dyn Engine>, String> {
        let host = host.as_ref().ok_or("the host passed no services")?;
        log::install(host.log);
        let args: CreateArgs = serde_json::from_slice(args.as_slice())
            .map_err(|e| format!("the host's engine arguments do not parse: {e}"))?;
        let config = serde_yaml::from_str(&args.config_yaml)
            .map_err(|e| format!("the engine's config section does not parse: {e}"))?;
        let ctx = EngineContext {
            name: args.name,
            config,
            config_dir: args.config_dir,
            model: args.model,
            shared: SharedHandle::from_ptr(host.shared),
        };
        guarded_create(ctx, constructor)
    }))
    .unwrap_or_else(|panic| {
        Err(format!(
            "the plugin panicked while creating the engine: {}",
            panic_message(&*panic)
        ))
    });
    match built {
        Ok(engine) => {
            *out = Box::into_raw(Box::new(engine)) as EngineHandle;
            true
        }
        Err(message) => {
            error.put(message.as_bytes());
            false
        }
    }
}

unsafe extern "C" fn submit(
    handle: EngineHandle,
    request: *const RawRequest,
    cancel: RawCancel,
    events: RawEventSink,
    error: ByteSink,
) -> bool {
    let cancel = CancelToken::from_raw(cancel);
    let events = EventSender::from_raw(events);
    let result = catch_unwind(AssertUnwindSafe(|| {
        let mut req = read_request(&*request).map_err(EngineError::Internal)?;
        req.cancel = cancel;
        engine(handle).submit_to(req, events)
    }))
    .unwrap_or_else(|panic| Err(EngineError::Failed(panic_message(&*panic))));
    match result {
        Ok(()) => true,
        Err(e) => {
            error.put(&json_or_empty(&e));
            false
        }
    }
}

unsafe extern "C" fn cancel(handle: EngineHandle, id: u64) {
    let _ = catch_unwind(AssertUnwindSafe(|| engine(handle).cancel(RequestId(id))));
}

unsafe extern "C" fn capabilities(handle: EngineHandle, out: ByteSink) {
    if let Ok(caps) = catch_unwind(AssertUnwindSafe(|| engine(handle).capabilities())) {
        out.put(&json_or_empty(&caps));
    }
}

unsafe extern "C" fn load(handle: EngineHandle, out: ByteSink) {
    if let Ok(load) = catch_unwind(AssertUnwindSafe(|| engine(handle).load())) {
        out.put(&json_or_empty(&load));
    }
}

unsafe extern "C" fn shutdown(handle: EngineHandle) {
    let _ = catch_unwind(AssertUnwindSafe(|| engine(handle).shutdown()));
}

unsafe extern "C" fn destroy(handle: EngineHandle) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        drop(Box::from_raw(handle as *mut Box<dyn Engine>))
    }));
}
