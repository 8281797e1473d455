//! The plugin ABI. An engine crate builds a `cdylib` that exports
//! [`ENTRY_SYMBOL`] (use [`export_engine!`]); the host reads the descriptor's
//! C-layout version fields first and only calls the Rust constructor when
//! the ABI version, this crate's version and the rustc version all match.

use std::any::Any;
use std::ffi::{c_char, CStr};
use std::sync::Arc;

use crate::engine::Engine;

/// Bump on any change to the descriptor or [`EngineContext`] layout.
pub const PLUGIN_ABI_VERSION: u32 = 3;
pub const CORE_VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
pub const RUSTC_VERSION: &str = concat!(env!("ENGINE_CORE_RUSTC_VERSION"), "\0");
pub const ENTRY_SYMBOL: &[u8] = b"engine_plugin_entry_v1\0";

pub type Constructor = fn(EngineContext) -> Result<Box<dyn Engine>, String>;

#[repr(C)]
pub struct PluginDescriptor {
    pub abi_version: u32,
    /// NUL-terminated engine-core version the plugin was built against.
    pub core_version: *const c_char,
    /// NUL-terminated `rustc --version` of the plugin's compiler.
    pub rustc_version: *const c_char,
    /// NUL-terminated engine kind (`batched`, `fastpath`, ...).
    pub kind: *const c_char,
    /// Only valid to call when the versions above match the host's.
    pub create: Constructor,
}

// The pointers refer to 'static strings inside the plugin image.
unsafe impl Sync for PluginDescriptor {}

impl PluginDescriptor {
    /// # Safety
    /// `ptr` must point at a NUL-terminated string that outlives the call.
    pub unsafe fn read_str(ptr: *const c_char) -> String {
        if ptr.is_null() {
            return String::new();
        }
        CStr::from_ptr(ptr).to_string_lossy().into_owned()
    }
}

pub type EntryFn = unsafe extern "C" fn() -> *const PluginDescriptor;

/// What the host gives each engine at construction. The process-wide state a
/// `cdylib` would otherwise hold a private copy of (the tracing dispatcher,
/// the tokio runtime) travels here and is installed by the plugin.
pub struct EngineContext {
    /// This engine's name in config.yaml.
    pub name: String,
    /// The engine's own section of config.yaml.
    pub config: serde_yaml::Value,
    /// The directory relative paths in `config` are relative to (the
    /// config file's).
    pub config_dir: std::path::PathBuf,
    /// The shared model runtime state (weights, KV pool, tokenizer facts);
    /// engines downcast it through the runtime crate.
    pub shared: Arc<dyn Any + Send + Sync>,
    /// Engines that this one may hand work to (for example fastpath hands a
    /// running sequence over to batched when another request arrives).
    pub peers: Arc<dyn Any + Send + Sync>,
    pub dispatch: tracing::Dispatch,
    pub tokio: tokio::runtime::Handle,
}

/// Exports a plugin entry point for `$constructor: fn(EngineContext) ->
/// Result<Box<dyn Engine>, String>`. The constructor and the engine it
/// builds run behind this plugin's own panic barrier
/// ([`guarded_create`](crate::panic_barrier::guarded_create)).
#[macro_export]
macro_rules! export_engine {
    ($kind:literal, $constructor:path) => {
        #[no_mangle]
        pub extern "C" fn engine_plugin_entry_v1() -> *const $crate::plugin::PluginDescriptor {
            static DESCRIPTOR: $crate::plugin::PluginDescriptor =
                $crate::plugin::PluginDescriptor {
                    abi_version: $crate::plugin::PLUGIN_ABI_VERSION,
                    core_version: $crate::plugin::CORE_VERSION.as_ptr()
                        as *const ::std::ffi::c_char,
                    rustc_version: $crate::plugin::RUSTC_VERSION.as_ptr()
                        as *const ::std::ffi::c_char,
                    kind: concat!($kind, "\0").as_ptr() as *const ::std::ffi::c_char,
                    create: __engine_plugin_create,
                };
            &DESCRIPTOR
        }

        fn __engine_plugin_create(
            ctx: $crate::plugin::EngineContext,
        ) -> ::std::result::Result<::std::boxed::Box<dyn $crate::Engine>, ::std::string::String> {
            $crate::panic_barrier::guarded_create(ctx, $constructor)
        }
    };
}
