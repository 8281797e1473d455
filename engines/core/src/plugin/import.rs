//! The host's side: a loaded plugin's function table behind the Rust
//! [`Engine`] trait.

use std::ffi::c_void;

use super::abi::{ByteSink, Bytes, EngineHandle, HostServices, PluginVTable};
use super::export::CreateArgs;
use super::log;
use super::wire::LentRequest;
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
            size: std::mem::size_of::<HostServices>(),
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
        let lent = LentRequest::new(&req)
            .map_err(|e| EngineError::Internal(format!("cannot encode the request: {e}")))?;
        let mut error = Vec::new();
        let ok = unsafe {
            (self.vtable.submit)(
                self.handle,
                &lent.raw(),
                req.cancel.clone().into_raw(),
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

#[cfg(test)]
mod tests {
    //! The whole function table in one process: a Rust engine exported the
    //! way `export_engine!` does, driven through `PluginEngine`.

    use std::sync::Mutex;

    use super::*;
    use crate::engine::Refusal;
    use crate::event::{Event, Finish, FinishReason, TokenEvent};
    use crate::plugin::abi::{ByteSink, Bytes, HostServices};
    use crate::plugin::{export, EngineContext};
    use crate::request::CancelToken;

    /// Echoes the prompt back; refuses prompts of more than 8 tokens (its
    /// queue is full); remembers the last cancel token it was given.
    struct Echo(String, Mutex<Option<CancelToken>>);

    impl Engine for Echo {
        fn name(&self) -> &str {
            &self.0
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                greedy_only: true,
                tools: false,
                images: true,
                ..Capabilities::default()
            }
        }
        fn submit_to(&self, req: GenerateRequest, events: EventSender) -> Result<(), EngineError> {
            if req.prompt.len() > 8 {
                return Err(Refusal::Busy.into());
            }
            if req.prompt.is_empty() {
                panic!("an empty prompt");
            }
            for &id in &req.prompt {
                let token = TokenEvent {
                    id,
                    logprob: None,
                    top_logprobs: Vec::new(),
                };
                events.send(Event::Token(token)).unwrap();
            }
            events
                .send(Event::Finished(Finish {
                    reason: FinishReason::Length,
                    prompt_tokens: req.prompt.len() as u32,
                    completion_tokens: req.prompt.len() as u32,
                    cached_tokens: 0,
                    spec: None,
                }))
                .unwrap();
            *self.1.lock().unwrap() = Some(req.cancel);
            Ok(())
        }
        fn cancel(&self, _id: RequestId) {
            if let Some(token) = &*self.1.lock().unwrap() {
                token.cancel();
            }
        }
        fn load(&self) -> EngineLoad {
            EngineLoad {
                active: 3,
                healthy: true,
                ..EngineLoad::default()
            }
        }
        fn shutdown(&self) {}
    }

    fn construct(ctx: EngineContext) -> Result<Box<dyn Engine>, String> {
        let greeting: String = ctx.config["greeting"].as_str().unwrap_or_default().into();
        if greeting == "fail" {
            return Err("asked to fail".into());
        }
        Ok(Box::new(Echo(
            format!("{} {greeting}", ctx.name),
            Mutex::new(None),
        )))
    }

    unsafe extern "C" fn create(
        args: Bytes,
        host: *const HostServices,
        out: *mut EngineHandle,
        error: ByteSink,
    ) -> bool {
        export::create(args, host, out, error, construct)
    }

    static VTABLE: PluginVTable = export::vtable(create);

    fn args(greeting: &str) -> CreateArgs {
        CreateArgs {
            name: "echo".into(),
            config_yaml: format!("greeting: {greeting}\n"),
            config_dir: "/".into(),
            model: None,
        }
    }

    #[test]
    fn an_engine_serves_through_the_function_table() {
        let engine =
            unsafe { PluginEngine::create(&VTABLE, &args("hi"), std::ptr::null()) }.unwrap();
        assert_eq!(engine.name(), "echo");
        assert!(engine.capabilities().greedy_only && engine.capabilities().images);
        assert_eq!((engine.load().active, engine.load().healthy), (3, true));

        let req = GenerateRequest::new(vec![5, 6, 7], 3);
        let (id, token) = (req.id, req.cancel.clone());
        let mut stream = engine.submit(req).unwrap();
        let mut ids = Vec::new();
        while let Ok(event) = stream.try_recv() {
            match event {
                Event::Token(t) => ids.push(t.id),
                Event::Finished(f) => assert_eq!(f.completion_tokens, 3),
                Event::Error(e) => panic!("{e}"),
            }
        }
        assert_eq!(ids, [5, 6, 7]);
        // Cancelling by id reaches the host's token through the plugin's.
        engine.cancel(id);
        assert!(token.is_cancelled());

        // A refusal comes back typed, for the router's fallback.
        assert_eq!(
            engine
                .submit(GenerateRequest::new(vec![1; 9], 1))
                .unwrap_err(),
            EngineError::Refused(Refusal::Busy)
        );
        // A panic stays in the plugin: the request fails, the engine is
        // out of service.
        let e = engine.submit(GenerateRequest::new(vec![], 1)).unwrap_err();
        assert!(
            matches!(&e, EngineError::Failed(m) if m.contains("an empty prompt")),
            "{e:?}"
        );
        assert!(!engine.load().healthy);
    }

    #[test]
    fn a_failing_constructor_reports_why() {
        let e = unsafe { PluginEngine::create(&VTABLE, &args("fail"), std::ptr::null()) }
            .err()
            .unwrap();
        assert_eq!(e, "asked to fail");
    }
}
