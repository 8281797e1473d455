//! The plugin boundary: a C ABI. A plugin (`cdylib`) exports
//! [`ENTRY_SYMBOL`], an `extern "C"` function returning a
//! [`abi::PluginDescriptor`]: the boundary's major version, the MLX it was
//! built against, the engine kind and a table of `extern "C"` functions.
//! Tokens and images' embeddings cross as C values; requests, finishes,
//! errors, loads and capabilities as JSON of the engine-core types
//! ([`wire`]); event sinks and cancel flags as C handles ([`handles`]); the
//! shared model state (runtime crate) as C tables over mlx-c array handles.
//! No Rust type, trait object or global crosses, so a plugin built in
//! another cargo invocation (its own target directory, its own feature
//! unification, even another rustc) loads as long as its major version and
//! MLX match. docs/plugins.md is the authors' guide.
//!
//! Both sides keep the Rust [`Engine`](crate::Engine) trait: the host wraps
//! a loaded plugin in [`import::PluginEngine`]; [`export_engine!`] wraps the
//! plugin's engine into the function table.

pub mod abi;
pub mod export;
pub mod handles;
pub mod import;
mod log;
pub mod wire;

use std::ffi::{c_char, c_void, CStr};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The boundary's major version: bumped by a change a plugin built before
/// it cannot live with (see [`abi`] for which changes are compatible).
pub const PLUGIN_ABI_VERSION: u32 = 5;

pub const ENTRY_SYMBOL: &[u8] = b"engine_plugin_entry_v2\0";
/// The entry symbol of plugins built before the C boundary.
pub const OLD_ENTRY_SYMBOL: &[u8] = b"engine_plugin_entry_v1\0";

/// The host's shared state as the plugin receives it: an opaque pointer the
/// runtime crate reads (`runtime::SharedModel::from_context`).
#[derive(Debug, Clone, Copy)]
pub struct SharedHandle(*const c_void);

// Points at host state that lives, immutable, for the whole process.
unsafe impl Send for SharedHandle {}
unsafe impl Sync for SharedHandle {}

impl SharedHandle {
    /// # Safety
    /// `ptr` is null or the host's `runtime::abi::RawShared`, live for the
    /// process.
    pub unsafe fn from_ptr(ptr: *const c_void) -> Self {
        SharedHandle(ptr)
    }

    pub fn none() -> Self {
        SharedHandle(std::ptr::null())
    }

    pub fn as_ptr(&self) -> *const c_void {
        self.0
    }
}

/// What an engine's constructor receives.
pub struct EngineContext {
    /// This engine's name in config.yaml.
    pub name: String,
    /// The engine's own section of config.yaml.
    pub config: serde_yaml::Value,
    /// The directory relative paths in `config` are relative to (the
    /// config file's).
    pub config_dir: PathBuf,
    /// The served model's name and tokenizer, for an engine that does not
    /// run it (the remote engine); `None` when the host serves no model.
    pub model: Option<ModelFacts>,
    /// The shared model, KV pool, device lock and handover slot; engines
    /// read it through `runtime::SharedModel::from_context`.
    pub shared: SharedHandle,
}

/// What an engine may know of the served model without linking MLX.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelFacts {
    /// The name the API serves the model under.
    pub name: String,
    pub tokenizer: TokenizerSource,
}

/// Where a model's tokenizer is read from (`text::Tokenizer::load`): a
/// directory's tokenizer.json (and tokenizer_config.json), or one rebuilt
/// from GGUF metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TokenizerSource {
    Dir(PathBuf),
    Json {
        json: String,
        config: serde_json::Value,
        origin: PathBuf,
    },
}

/// A NUL-terminated string from a descriptor, lossily decoded.
///
/// # Safety
/// `ptr` is null or points at a NUL-terminated string that outlives the
/// call.
pub unsafe fn read_c_str(ptr: *const c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    CStr::from_ptr(ptr).to_string_lossy().into_owned()
}

/// Exports a plugin entry point for `$constructor: fn(EngineContext) ->
/// Result<Box<dyn Engine>, String>`. The constructor and the engine it
/// builds run behind this plugin's own panic barrier
/// ([`guarded_create`](crate::panic_barrier::guarded_create)); the first
/// `create` installs this plugin's `tracing` subscriber, which forwards to
/// the host's log. Engines over the shared model use
/// `runtime::export_engine!`, which adds the MLX fingerprint.
#[macro_export]
macro_rules! export_engine {
    ($kind:literal, $constructor:path) => {
        $crate::export_engine!($kind, $constructor, mlx = "\0");
    };
    ($kind:literal, $constructor:path, mlx = $mlx:expr) => {
        #[no_mangle]
        pub extern "C" fn engine_plugin_entry_v2() -> *const $crate::plugin::abi::PluginDescriptor {
            static VTABLE: $crate::plugin::abi::PluginVTable =
                $crate::plugin::export::vtable(__engine_plugin_create);
            static DESCRIPTOR: $crate::plugin::abi::PluginDescriptor =
                $crate::plugin::abi::PluginDescriptor {
                    abi_version: $crate::plugin::PLUGIN_ABI_VERSION,
                    mlx: $mlx.as_ptr() as *const ::std::ffi::c_char,
                    kind: concat!($kind, "\0").as_ptr() as *const ::std::ffi::c_char,
                    vtable: &VTABLE,
                };
            &DESCRIPTOR
        }

        unsafe extern "C" fn __engine_plugin_create(
            args: $crate::plugin::abi::Bytes,
            host: *const $crate::plugin::abi::HostServices,
            out: *mut $crate::plugin::abi::EngineHandle,
            error: $crate::plugin::abi::ByteSink,
        ) -> bool {
            $crate::plugin::export::create(args, host, out, error, $constructor)
        }
    };
}
