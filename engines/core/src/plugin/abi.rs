//! The C structures that cross the plugin boundary. Nothing here depends on
//! how a crate was compiled: plain integers, pointers and `extern "C"`
//! functions. Token events and images' embeddings cross as C values; the
//! rarer rich values (requests, finishes, errors, loads, capabilities) as
//! JSON bytes of the engine-core types.
//!
//! Ownership: a `Raw*` handle has exactly one owner, who calls its
//! `release` once. Handles passed into a call are owned by the callee from
//! then on, whatever the call returns.
//!
//! Versions ([`PLUGIN_ABI_VERSION`](super::PLUGIN_ABI_VERSION)): the tables
//! one side builds for the other to read for the process
//! ([`HostServices`], [`PluginVTable`], `runtime::abi::RawShared`) start
//! with their `size` in bytes and grow only at their end, so a reader
//! reads a member added after its builder was built only where `size`
//! reaches past it. Anything else (a member changed, moved or removed, a
//! handle or call argument changed, a JSON field changed in type or
//! meaning) is a new major version, and the host refuses plugins of
//! another.

use std::ffi::{c_char, c_void};

/// Bytes lent for the duration of one call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Bytes {
    pub ptr: *const u8,
    pub len: usize,
}

impl Bytes {
    pub fn new(bytes: &[u8]) -> Self {
        Bytes {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        }
    }

    /// # Safety
    /// `ptr` points at `len` readable bytes for the lifetime `'a`.
    pub unsafe fn as_slice<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.len == 0 {
            return &[];
        }
        std::slice::from_raw_parts(self.ptr, self.len)
    }
}

/// Where a callee writes bytes it returns (the caller owns the buffer, so
/// no allocation crosses the boundary).
#[repr(C)]
pub struct ByteSink {
    pub ctx: *mut c_void,
    pub write: unsafe extern "C" fn(ctx: *mut c_void, bytes: Bytes),
}

impl ByteSink {
    /// A sink that appends to `out`, valid while `out` is.
    pub fn to_vec(out: &mut Vec<u8>) -> ByteSink {
        unsafe extern "C" fn write(ctx: *mut c_void, bytes: Bytes) {
            (*(ctx as *mut Vec<u8>)).extend_from_slice(bytes.as_slice());
        }
        ByteSink {
            ctx: out as *mut Vec<u8> as *mut c_void,
            write,
        }
    }

    /// # Safety
    /// The sink's context is still valid.
    pub unsafe fn put(&self, bytes: &[u8]) {
        (self.write)(self.ctx, Bytes::new(bytes))
    }
}

/// The receiving end of one request's events.
#[repr(C)]
pub struct RawEventSink {
    pub ctx: *mut c_void,
    /// A token. False when the receiver is gone (the client left).
    pub send_token: unsafe extern "C" fn(ctx: *mut c_void, token: *const RawToken) -> bool,
    /// Any other event, as JSON of [`crate::Event`]; false as `send_token`.
    pub send: unsafe extern "C" fn(ctx: *mut c_void, event: Bytes) -> bool,
    pub is_closed: unsafe extern "C" fn(ctx: *mut c_void) -> bool,
    pub release: unsafe extern "C" fn(ctx: *mut c_void),
}

/// A [`crate::TokenEvent`], its arrays lent for the call.
#[repr(C)]
pub struct RawToken {
    pub id: u32,
    pub has_logprob: bool,
    pub logprob: f32,
    /// The alternatives: `top_len` ids and their log-probabilities.
    pub top_ids: *const u32,
    pub top_logprobs: *const f32,
    pub top_len: usize,
}

/// A [`crate::GenerateRequest`], lent for the call: JSON without its
/// images' embeddings, which follow as floats, one run per image in order.
#[repr(C)]
pub struct RawRequest {
    pub json: Bytes,
    pub embeddings: *const Floats,
    pub images: usize,
}

/// `len` floats lent for the call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Floats {
    pub ptr: *const f32,
    pub len: usize,
}

/// One request's cancellation flag.
#[repr(C)]
pub struct RawCancel {
    pub ctx: *mut c_void,
    pub is_cancelled: unsafe extern "C" fn(ctx: *mut c_void) -> bool,
    pub cancel: unsafe extern "C" fn(ctx: *mut c_void),
    pub release: unsafe extern "C" fn(ctx: *mut c_void),
}

/// Log records from the plugin's `tracing` into the host's.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawLog {
    pub ctx: *mut c_void,
    /// `level`: 1 error, 2 warn, 3 info, 4 debug, 5 trace. `target`: the
    /// plugin's module path; `message`: the message and its fields.
    pub log: unsafe extern "C" fn(ctx: *mut c_void, level: u8, target: Bytes, message: Bytes),
    /// The most verbose level the host records (same codes; 0: none).
    pub max_level: u8,
}

/// What the host lends a plugin for the life of the process.
#[repr(C)]
pub struct HostServices {
    /// This table's size in bytes as the host built it.
    pub size: usize,
    pub log: RawLog,
    /// The shared model state (`runtime::abi::RawShared`); null when the
    /// host shares none.
    pub shared: *const c_void,
}

/// An engine built by a plugin.
pub type EngineHandle = *mut c_void;

/// The functions a plugin exports, all panic-free (panics are caught on the
/// plugin's side and reported as errors).
#[repr(C)]
pub struct PluginVTable {
    /// This table's size in bytes as the plugin built it.
    pub size: usize,
    /// Builds an engine from `args` (JSON: name, YAML config section,
    /// config directory). On success writes the engine to `out`; on failure
    /// writes the reason to `error` and returns false.
    pub create: unsafe extern "C" fn(
        args: Bytes,
        host: *const HostServices,
        out: *mut EngineHandle,
        error: ByteSink,
    ) -> bool,
    /// Schedules a request; takes `cancel` and `events` whatever it
    /// returns. On failure writes the JSON `EngineError` to `error`.
    pub submit: unsafe extern "C" fn(
        engine: EngineHandle,
        request: *const RawRequest,
        cancel: RawCancel,
        events: RawEventSink,
        error: ByteSink,
    ) -> bool,
    pub cancel: unsafe extern "C" fn(engine: EngineHandle, request_id: u64),
    /// Writes the JSON `Capabilities`.
    pub capabilities: unsafe extern "C" fn(engine: EngineHandle, out: ByteSink),
    /// Writes the JSON `EngineLoad`.
    pub load: unsafe extern "C" fn(engine: EngineHandle, out: ByteSink),
    pub shutdown: unsafe extern "C" fn(engine: EngineHandle),
    pub destroy: unsafe extern "C" fn(engine: EngineHandle),
}

/// What the entry symbol returns: a static in the plugin image.
#[repr(C)]
pub struct PluginDescriptor {
    /// The boundary's major version
    /// ([`PLUGIN_ABI_VERSION`](super::PLUGIN_ABI_VERSION)); read before any
    /// other field.
    pub abi_version: u32,
    /// NUL-terminated MLX fingerprint (`runtime::abi::MLX_FINGERPRINT`),
    /// empty when the plugin does not link MLX.
    pub mlx: *const c_char,
    /// NUL-terminated engine kind (`batched`, `fastpath`, ...).
    pub kind: *const c_char,
    pub vtable: *const PluginVTable,
}

// The pointers refer to statics inside the plugin image.
unsafe impl Sync for PluginDescriptor {}

pub type EntryFn = unsafe extern "C" fn() -> *const PluginDescriptor;

#[cfg(test)]
mod tests {
    use std::mem::offset_of;

    use super::*;

    /// Where major version 5's members stand. A member added at a table's
    /// end leaves these as they are; one changed in size, moved or removed
    /// moves them: that is a new major version (`PLUGIN_ABI_VERSION`) and
    /// new numbers here.
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn the_tables_keep_their_major_versions_layout() {
        assert_eq!(super::super::PLUGIN_ABI_VERSION, 5);
        macro_rules! at {
            ($t:ty: $($f:ident),*) => { [$(offset_of!($t, $f)),*] };
        }
        assert_eq!(
            at!(PluginDescriptor: abi_version, mlx, kind, vtable),
            [0, 8, 16, 24]
        );
        assert_eq!(
            at!(PluginVTable: size, create, submit, cancel, capabilities, load, shutdown, destroy),
            [0, 8, 16, 24, 32, 40, 48, 56]
        );
        assert_eq!(at!(HostServices: size, log, shared), [0, 8, 32]);
        assert_eq!(at!(RawLog: ctx, log, max_level), [0, 8, 16]);
        assert_eq!(
            at!(RawEventSink: ctx, send_token, send, is_closed, release),
            [0, 8, 16, 24, 32]
        );
        assert_eq!(
            at!(RawCancel: ctx, is_cancelled, cancel, release),
            [0, 8, 16, 24]
        );
        assert_eq!(
            at!(RawToken: id, has_logprob, logprob, top_ids, top_logprobs, top_len),
            [0, 4, 8, 16, 24, 32]
        );
        assert_eq!(at!(RawRequest: json, embeddings, images), [0, 16, 24]);
        assert_eq!(at!(Floats: ptr, len), [0, 8]);
        assert_eq!(at!(Bytes: ptr, len), [0, 8]);
        assert_eq!(at!(ByteSink: ctx, write), [0, 8]);
    }
}
