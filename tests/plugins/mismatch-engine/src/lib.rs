//! A plugin as a build against another MLX would look to the host: the
//! entry symbol and the boundary's major version are current, the MLX
//! fingerprint is not. The host must refuse it after reading the
//! descriptor and never call `create`.

use std::ffi::c_char;

use engine_core::plugin::abi::{
    ByteSink, Bytes, EngineHandle, HostServices, PluginDescriptor, PluginVTable,
};
use engine_core::plugin::{export, PLUGIN_ABI_VERSION};

pub const MLX: &std::ffi::CStr = c"mlx 0.0.0-mismatch, mlx-c of mlx-sys 0.0.0, shared state v1";

unsafe extern "C" fn create(
    _args: Bytes,
    _host: *const HostServices,
    _out: *mut EngineHandle,
    error: ByteSink,
) -> bool {
    error.put(b"engine-mismatch must never be constructed: its MLX does not match");
    false
}

static VTABLE: PluginVTable = export::vtable(create);

#[no_mangle]
pub extern "C" fn engine_plugin_entry_v2() -> *const PluginDescriptor {
    static DESCRIPTOR: PluginDescriptor = PluginDescriptor {
        abi_version: PLUGIN_ABI_VERSION,
        mlx: MLX.as_ptr(),
        kind: c"mismatch".as_ptr() as *const c_char,
        vtable: &VTABLE,
    };
    &DESCRIPTOR
}
