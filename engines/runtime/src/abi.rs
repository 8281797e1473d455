//! The shared model state across the plugin boundary, as C tables: the
//! host's device lock, KV pool ledger and handover slot, and the model's
//! weights as mlx-c array handles (libmlx is one shared library in the
//! process, so a handle made by one image is valid in every other). A
//! plugin builds its own `SharedModel` over them
//! ([`SharedModel::from_context`](crate::SharedModel::from_context)).
//!
//! Ownership follows engine-core's `plugin::abi`: one owner per handle.
//! Everything the host exports here lives for the process.
//!
//! Any change to this file changes [`MLX_FINGERPRINT`] (build.rs hashes it),
//! and the host refuses plugins built against the old one.

use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};

use engine_core::plugin::abi::{Bytes, RawCancel, RawEventSink};
use engine_core::{CancelToken, EventSender, GenerateRequest};
use mlx_rs::Array;
use mlx_sys::mlx_array;

use crate::cache::KvCache;
use crate::handover::{Handover, HandoverSink};
use crate::kv_pool::KvPool;

/// The MLX headers and mlx-c this build compiled against and the hash of
/// this file, NUL-terminated: the descriptor's `mlx` field.
pub const MLX_FINGERPRINT: &str = concat!(env!("RUNTIME_MLX_FINGERPRINT"), "\0");

/// [`MLX_FINGERPRINT`] without its NUL.
pub fn mlx_fingerprint() -> &'static str {
    MLX_FINGERPRINT.trim_end_matches('\0')
}

/// What the host shares with every plugin (`HostServices::shared`).
#[repr(C)]
pub struct RawShared {
    /// The host's [`MLX_FINGERPRINT`].
    pub mlx: *const c_char,
    /// NUL-terminated checkpoint path (directory or GGUF file), served
    /// name and compute dtype (`model.compute_dtype`).
    pub model_path: *const c_char,
    pub model_name: *const c_char,
    pub compute_dtype: *const c_char,
    /// Every weight, in `LoadedModel::parameters` order.
    pub arrays: *const mlx_array,
    pub arrays_len: usize,
    pub device: RawDeviceLock,
    pub kv: RawKvLedger,
    pub handover: RawHandoverSlot,
}

/// The lock that serialises device work across engines.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawDeviceLock {
    pub ctx: *mut c_void,
    pub lock: unsafe extern "C" fn(ctx: *mut c_void),
    pub unlock: unsafe extern "C" fn(ctx: *mut c_void),
}

/// The KV block pool's count.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RawKvLedger {
    pub ctx: *mut c_void,
    pub total: usize,
    pub block_size: usize,
    pub bytes_per_block: usize,
    /// Blocks each sequence's recurrent state takes (hybrid models).
    pub state_blocks: usize,
    /// Adds `blocks` when they fit; false when the pool is full.
    pub try_reserve: unsafe extern "C" fn(ctx: *mut c_void, blocks: usize) -> bool,
    pub release: unsafe extern "C" fn(ctx: *mut c_void, blocks: usize),
    pub allocated: unsafe extern "C" fn(ctx: *mut c_void) -> usize,
}

/// Where the engine that adopts handed-over sequences registers.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawHandoverSlot {
    pub ctx: *mut c_void,
    pub set: unsafe extern "C" fn(ctx: *mut c_void, sink: RawHandoverSink),
    /// Writes the registered sink to `out`; false when none is.
    pub get: unsafe extern "C" fn(ctx: *mut c_void, out: *mut RawHandoverSink) -> bool,
}

/// An engine that adopts sequences; lives for the process once registered.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawHandoverSink {
    pub ctx: *mut c_void,
    /// True: the sink took the sequence (its cancel and event handles and
    /// its reserved blocks are the sink's now; the arrays are only lent).
    /// False: nothing was taken.
    pub adopt: unsafe extern "C" fn(ctx: *mut c_void, handover: *const RawHandover) -> bool,
    pub busy: unsafe extern "C" fn(ctx: *mut c_void) -> bool,
}

/// A running sequence (`handover::Handover`) in C form.
#[repr(C)]
pub struct RawHandover {
    /// JSON of the `GenerateRequest`.
    pub request: Bytes,
    pub cancel: RawCancel,
    pub events: RawEventSink,
    /// Per layer; a null handle for a layer not yet written.
    pub keys: *const mlx_array,
    pub values: *const mlx_array,
    /// Per layer, a linear-attention layer's recurrent state (convolution
    /// inputs and delta-rule state); null handles for other layers.
    pub conv: *const mlx_array,
    pub ssm: *const mlx_array,
    pub layers: usize,
    pub len: i32,
    pub capacity: i32,
    pub left_pad: *const i32,
    pub batch: usize,
    pub last_token: u32,
    /// Tokens streamed so far (`last_token` included).
    pub generated: *const u32,
    pub generated_len: usize,
    pub cached_tokens: u32,
    pub reserved_blocks: usize,
}

/// A new handle of our own to the host's array.
///
/// # Safety
/// `handle` is a live mlx-c array handle.
pub(crate) unsafe fn retain(handle: mlx_array) -> Array {
    let mut mine = mlx_sys::mlx_array_new();
    mlx_sys::mlx_array_set(&mut mine, handle);
    Array::from_ptr(mine)
}

fn null_array() -> mlx_array {
    mlx_array {
        ctx: std::ptr::null_mut(),
    }
}

/// Exclusive use of the device: the host's lock, or the host's through C.
pub(crate) enum DeviceLock {
    Local { locked: Mutex<bool>, free: Condvar },
    Foreign(RawDeviceLock),
}

// The host's lock functions are thread-safe.
unsafe impl Send for DeviceLock {}
unsafe impl Sync for DeviceLock {}

/// Holds the device until dropped.
pub struct DeviceGuard<'a>(&'a DeviceLock);

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

impl DeviceLock {
    pub(crate) fn new() -> Self {
        DeviceLock::Local {
            locked: Mutex::new(false),
            free: Condvar::new(),
        }
    }

    pub(crate) fn lock(&self) -> DeviceGuard<'_> {
        self.acquire();
        DeviceGuard(self)
    }

    // A panicked holder left nothing half-written that matters here, so
    // poisoning is ignored.
    fn acquire(&self) {
        match self {
            DeviceLock::Local { locked, free } => {
                let mut held = locked.lock().unwrap_or_else(|p| p.into_inner());
                while *held {
                    held = free.wait(held).unwrap_or_else(|p| p.into_inner());
                }
                *held = true;
            }
            DeviceLock::Foreign(raw) => unsafe { (raw.lock)(raw.ctx) },
        }
    }

    /// Releases a lock taken by a guard that was forgotten (the C unlock).
    pub(crate) fn release_raw(&self) {
        self.release();
    }

    fn release(&self) {
        match self {
            DeviceLock::Local { locked, free } => {
                *locked.lock().unwrap_or_else(|p| p.into_inner()) = false;
                free.notify_one();
            }
            DeviceLock::Foreign(raw) => unsafe { (raw.unlock)(raw.ctx) },
        }
    }
}

/// A handover sink registered through C (by another image, or exported by
/// this one).
pub(crate) struct ForeignSink(pub(crate) RawHandoverSink);

unsafe impl Send for ForeignSink {}
unsafe impl Sync for ForeignSink {}

impl HandoverSink for ForeignSink {
    fn adopt(&self, h: Handover) -> Result<(), Box<Handover>> {
        let Ok(request) = serde_json::to_vec(&h.request) else {
            return Err(Box::new(h));
        };
        let handle = |a: &Option<Array>| a.as_ref().map_or_else(null_array, Array::as_ptr);
        let keys: Vec<mlx_array> = h.cache.keys.iter().map(handle).collect();
        let values: Vec<mlx_array> = h.cache.values.iter().map(handle).collect();
        let recurrent = |f: fn(&crate::cache::Recurrent) -> &Array| -> Vec<mlx_array> {
            h.cache
                .recurrent
                .iter()
                .map(|r| r.as_ref().map_or_else(null_array, |r| f(r).as_ptr()))
                .collect()
        };
        let (conv, ssm) = (recurrent(|r| &r.conv), recurrent(|r| &r.ssm));
        let raw = RawHandover {
            request: Bytes::new(&request),
            cancel: h.request.cancel.clone().into_raw(),
            events: h.events.clone().into_raw(),
            keys: keys.as_ptr(),
            values: values.as_ptr(),
            conv: conv.as_ptr(),
            ssm: ssm.as_ptr(),
            layers: keys.len(),
            len: h.cache.len,
            capacity: h.cache.capacity,
            left_pad: h.cache.left_pad.as_ptr(),
            batch: h.cache.left_pad.len(),
            last_token: h.last_token,
            generated: h.generated.as_ptr(),
            generated_len: h.generated.len(),
            cached_tokens: h.cached_tokens,
            reserved_blocks: h.reservation.blocks(),
        };
        // SAFETY: the sink lives for the process; `raw` outlives the call.
        if unsafe { (self.0.adopt)(self.0.ctx, &raw) } {
            // The adopter holds the blocks now.
            h.reservation.into_blocks();
            return Ok(());
        }
        unsafe {
            (raw.cancel.release)(raw.cancel.ctx);
            (raw.events.release)(raw.events.ctx);
        }
        Err(Box::new(h))
    }

    fn busy(&self) -> bool {
        unsafe { (self.0.busy)(self.0.ctx) }
    }

    fn raw(&self) -> Option<RawHandoverSink> {
        Some(self.0)
    }
}

/// What an exported sink's functions reach: the sink, and the pool its
/// adopted blocks belong to.
struct SinkCtx {
    sink: Arc<dyn HandoverSink>,
    pool: KvPool,
}

/// `sink` as a C handle; it lives for the process.
pub(crate) fn export_sink(sink: Arc<dyn HandoverSink>, pool: KvPool) -> RawHandoverSink {
    if let Some(raw) = sink.raw() {
        return raw;
    }
    unsafe extern "C" fn adopt(ctx: *mut c_void, raw: *const RawHandover) -> bool {
        catch_unwind(AssertUnwindSafe(|| {
            let ctx = &*(ctx as *const SinkCtx);
            let raw = &*raw;
            let Ok(mut request) = serde_json::from_slice::<GenerateRequest>(raw.request.as_slice())
            else {
                return false;
            };
            let arrays = |ptr: *const mlx_array| -> Vec<Option<Array>> {
                (0..raw.layers)
                    .map(|i| {
                        let h = *ptr.add(i);
                        (!h.ctx.is_null()).then(|| retain(h))
                    })
                    .collect()
            };
            let mut cache = KvCache::new(raw.layers, raw.batch);
            cache.keys = arrays(raw.keys);
            cache.values = arrays(raw.values);
            cache.recurrent = arrays(raw.conv)
                .into_iter()
                .zip(arrays(raw.ssm))
                .map(|(conv, ssm)| {
                    Some(crate::cache::Recurrent {
                        conv: conv?,
                        ssm: ssm?,
                    })
                })
                .collect();
            cache.len = raw.len;
            cache.capacity = raw.capacity;
            cache.left_pad = std::slice::from_raw_parts(raw.left_pad, raw.batch).to_vec();
            request.cancel = CancelToken::from_raw(std::ptr::read(&raw.cancel));
            let handover = Handover {
                request,
                cache,
                last_token: raw.last_token,
                generated: std::slice::from_raw_parts(raw.generated, raw.generated_len).to_vec(),
                cached_tokens: raw.cached_tokens,
                reservation: ctx.pool.adopt(raw.reserved_blocks),
                events: EventSender::from_raw(std::ptr::read(&raw.events)),
            };
            match ctx.sink.adopt(handover) {
                Ok(()) => true,
                Err(h) => {
                    // Given back: the caller still owns the handles and
                    // the blocks, so none is released here.
                    let h = *h;
                    h.reservation.into_blocks();
                    std::mem::forget(h.events);
                    std::mem::forget(h.request.cancel);
                    false
                }
            }
        }))
        .unwrap_or(false)
    }
    unsafe extern "C" fn busy(ctx: *mut c_void) -> bool {
        catch_unwind(AssertUnwindSafe(|| (*(ctx as *const SinkCtx)).sink.busy())).unwrap_or(false)
    }
    RawHandoverSink {
        ctx: Box::into_raw(Box::new(SinkCtx { sink, pool })) as *mut c_void,
        adopt,
        busy,
    }
}

/// Registers `engine_core`'s runtime macro for plugins over the shared
/// model: [`engine_core::export_engine!`] with this build's
/// [`MLX_FINGERPRINT`], so the host refuses the plugin at load when it was
/// built against another MLX, mlx-c or shared-state layout.
#[macro_export]
macro_rules! export_engine {
    ($kind:literal, $constructor:path) => {
        $crate::__engine_core::export_engine!(
            $kind,
            $constructor,
            mlx = $crate::abi::MLX_FINGERPRINT
        );
    };
}
