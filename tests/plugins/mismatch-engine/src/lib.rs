//! A plugin as an older or newer build would look to the host: the entry
//! symbol is the same, the descriptor's ABI and engine-core versions are
//! not. The host must refuse it after reading the descriptor and never call
//! `create`.

use std::ffi::c_char;

use engine_core::plugin::{PluginDescriptor, PLUGIN_ABI_VERSION, RUSTC_VERSION};
use engine_core::{Engine, EngineContext};

fn create(_ctx: EngineContext) -> Result<Box<dyn Engine>, String> {
    Err("engine-mismatch must never be constructed: its versions do not match".into())
}

#[no_mangle]
pub extern "C" fn engine_plugin_entry_v1() -> *const PluginDescriptor {
    static DESCRIPTOR: PluginDescriptor = PluginDescriptor {
        abi_version: PLUGIN_ABI_VERSION + 1000,
        core_version: c"0.0.0-mismatch".as_ptr(),
        rustc_version: RUSTC_VERSION.as_ptr() as *const c_char,
        kind: c"mismatch".as_ptr(),
        create,
    };
    &DESCRIPTOR
}
