//! The host's side: a loaded plugin's function table behind the Rust
//! [`Engine`] trait.

use std::ffi::c_void;

use super::abi::{ByteSink, Bytes, EngineHandle, HostServices, PluginVTable};
use super::export::CreateArgs;
use super::log;
use crate::engine::{Capabilities, Engine, EngineError, EngineLoad};
use crate::event::EventSender;
use crate::request::{GenerateRequest, RequestId};

pub struct PluginEngine {
    name: String,
    vtable: &'static PluginVTable,
    handle: EngineHandle,
}

// The plugin's engine is `Send + Sync` (the trait requires it) and its
// table is plain functions.
unsafe impl Send for PluginEngine {}
unsafe impl Sync for PluginEngine {}

impl PluginEngine {
    /// Builds an engine through the plugin's `create`.
    ///
    /// # Safety
    /// `vtable` belongs to a plugin that stays loaded for the process and
    /// whose fingerprints matched this host's; `shared` is null or a
    /// `runtime::abi::RawShared` that lives for the process.
    pub unsafe fn create(
        vtable: &'static PluginVTable,
        args: &CreateArgs,
        shared: *const c_void,
    ) -> Result<Self, String> {
        // Lent for the process: engines keep the logger and shared state.
        let host: &'static HostServices = Box::leak(Box::new(HostServices {
            log: log::host_log(),
            shared,
        }));
        let args_json = serde_json::to_vec(args).map_err(|e| e.to_string())?;
        let mut handle: EngineHandle = std::ptr::null_mut();
        let mut error = Vec::new();
        let ok = (vtable.create)(
            Bytes::new(&args_json),
            host,
            &mut handle,
            ByteSink::to_vec(&mut error),
        );
        if !ok || handle.is_null() {
            return Err(String::from_utf8_lossy(&error).into_owned());
        }
        Ok(PluginEngine {
            name: args.name.clone(),
            vtable,
            handle,
        })
    }

    fn read<T: serde::de::DeserializeOwned>(
        &self,
        call: unsafe extern "C" fn(EngineHandle, ByteSink),
    ) -> Option<T> {
        let mut out = Vec::new();
        unsafe { call(self.handle, ByteSink::to_vec(&mut out)) };
        serde_json::from_slice(&out).ok()
    }
}

impl Engine for PluginEngine {
    fn name(&self) -> &str {
        &self.name
    }

    fn capabilities(&self) -> Capabilities {
        self.read(self.vtable.capabilities).unwrap_or_default()
    }

    fn submit_to(&self, req: GenerateRequest, events: EventSender) -> Result<(), EngineError> {
        let json = serde_json::to_vec(&req)
            .map_err(|e| EngineError::Internal(format!("cannot encode the request: {e}")))?;
        let mut error = Vec::new();
        let ok = unsafe {
            (self.vtable.submit)(
                self.handle,
                Bytes::new(&json),
                req.cancel.into_raw(),
                events.into_raw(),
                ByteSink::to_vec(&mut error),
            )
        };
        if ok {
            return Ok(());
        }
        Err(serde_json::from_slice(&error).unwrap_or_else(|_| {
            EngineError::Internal(format!(
                "the plugin refused the request with an unreadable error: {}",
                String::from_utf8_lossy(&error)
            ))
        }))
    }

    fn cancel(&self, id: RequestId) {
        unsafe { (self.vtable.cancel)(self.handle, id.0) }
    }

    fn load(&self) -> EngineLoad {
        // An engine whose load cannot be read is not healthy.
        self.read(self.vtable.load).unwrap_or_default()
    }

    fn shutdown(&self) {
        unsafe { (self.vtable.shutdown)(self.handle) }
    }
}

impl Drop for PluginEngine {
    fn drop(&mut self) {
        unsafe { (self.vtable.destroy)(self.handle) }
    }
}
