//! The shared model state across the plugin boundary, as C tables: the
//! host's device lock, KV pool ledger, paged KV pool, handover slot and
//! prefix cache, and the model's weights as mlx-c array handles (libmlx is
//! one shared library in the process, so a handle made by one image is
//! valid in every other). The domain modules know nothing of it: each
//! service is a trait there with the host's implementation beside it;
//! [`export`] makes C tables of any implementation, and [`foreign`] is the
//! one implementation of each trait over the host's tables, from which a
//! plugin builds its own `SharedModel`
//! ([`SharedModel::from_context`](crate::SharedModel::from_context)).
//!
//! Ownership follows engine-core's `plugin::abi`: one owner per handle.
//! Everything the host exports here lives for the process. Versions follow
//! it too: [`RawShared`] starts with its size and grows only at its end;
//! any other change to these tables bumps the shared-state version in
//! [`MLX_FINGERPRINT`], and the host refuses plugins built before it.

use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use engine_core::plugin::abi::{Bytes, RawCancel, RawEventSink, RawRequest};
use mlx_sys::mlx_array;

use crate::kv_quant::KvQuant;

pub mod export;
pub mod foreign;
mod handover;
mod kv;

pub(crate) use kv::{null_array, retain, LentKv};

/// `value` behind a thin pointer, for a table's `ctx`; never freed.
pub(crate) fn leak<T>(value: T) -> *mut c_void {
    Box::into_raw(Box::new(value)) as *mut c_void
}

/// # Safety
/// `ctx` came from [`leak`] of a `T`.
pub(crate) unsafe fn ctx<'a, T>(ctx: *mut c_void) -> &'a T {
    &*(ctx as *const T)
}

/// `f`'s value, or `fallback` when it panics: no panic unwinds into the
/// calling image.
pub(crate) fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// The MLX headers and mlx-c this build compiled against and the version
/// of the shared-state tables here, NUL-terminated: the descriptor's `mlx`
/// field. Bump the version on any change to the tables but an addition at
/// [`RawShared`]'s end.
pub const MLX_FINGERPRINT: &str = concat!(env!("RUNTIME_MLX_FINGERPRINT"), ", shared state v3\0");

/// [`MLX_FINGERPRINT`] without its NUL.
pub fn mlx_fingerprint() -> &'static str {
    MLX_FINGERPRINT.trim_end_matches('\0')
}

/// What the host shares with every plugin (`HostServices::shared`).
#[repr(C)]
pub struct RawShared {
    /// This table's size in bytes as the host built it.
    pub size: usize,
    /// The host's [`MLX_FINGERPRINT`].
    pub mlx: *const c_char,
    /// NUL-terminated checkpoint path (directory or GGUF file), served
    /// name and compute dtype (`model.compute_dtype`).
    pub model_path: *const c_char,
    pub model_name: *const c_char,
    pub compute_dtype: *const c_char,
    /// `model.kv_cache` as `bits:group_size`, empty when off.
    pub kv_cache: *const c_char,
    /// Every weight, in `LoadedModel::parameters` order.
    pub arrays: *const mlx_array,
    pub arrays_len: usize,
    pub device: RawDeviceLock,
    pub kv: RawKvLedger,
    pub handover: RawHandoverSlot,
    pub prefix: RawPrefixCache,
    /// The paged KV pool (`paged::PagePool`), null when the server's KV
    /// is contiguous.
    pub pages: *const RawPagePool,
    /// Waiting for the pool's blocks to come back.
    pub kv_waits: RawKvWaits,
}

/// The host's paged KV pool. Block ids index its buffers' blocks; each
/// holder of a block (a `paged::Block`, in any image) is one count.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawPagePool {
    pub ctx: *mut c_void,
    /// The pool's identity (`paged::PageStore::key`).
    pub key: usize,
    /// Positions per block, blocks (the padding block 0 included), layers.
    pub block: i32,
    pub blocks: u32,
    pub layers: usize,
    /// A free block's id to `out`, counted once; false when none is free.
    pub allocate: unsafe extern "C" fn(ctx: *mut c_void, out: *mut u32) -> bool,
    pub retain: unsafe extern "C" fn(ctx: *mut c_void, id: u32),
    pub release: unsafe extern "C" fn(ctx: *mut c_void, id: u32),
    pub holders: unsafe extern "C" fn(ctx: *mut c_void, id: u32) -> u32,
    pub free_blocks: unsafe extern "C" fn(ctx: *mut c_void) -> usize,
    /// Layer `layer`'s buffers to `out` (up to [`KV_BUFFERS`] handles, each
    /// then the caller's); 0 before the layer's first write.
    pub buffers: unsafe extern "C" fn(ctx: *mut c_void, layer: usize, out: *mut mlx_array) -> usize,
    /// Every written layer's buffers to `out` (at most `cap`).
    pub state: unsafe extern "C" fn(ctx: *mut c_void, out: *mut mlx_array, cap: usize) -> usize,
    /// Writes `parts` (lent; in either layout `PagePool::write` takes) at
    /// `slots` into layer `layer`; its new buffers to `out` as `buffers`
    /// does, or 0 and a NUL-terminated message in `err`.
    pub write: unsafe extern "C" fn(
        ctx: *mut c_void,
        layer: usize,
        parts: *const mlx_array,
        parts_len: usize,
        slots: *const i32,
        slots_len: usize,
        out: *mut mlx_array,
        err: *mut u8,
        err_cap: usize,
    ) -> usize,
    pub copy_block: unsafe extern "C" fn(ctx: *mut c_void, from: u32, to: u32) -> bool,
    /// Layer `layer` was written in place by the node `written` (lent) is
    /// the token of (`paged::PageStore::mark_written`); false when the
    /// layer has no buffers written in place.
    pub mark_written:
        unsafe extern "C" fn(ctx: *mut c_void, layer: usize, written: mlx_array) -> bool,
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
    /// The memory budget's measured step in tokens (0: no budget).
    pub step_tokens: usize,
    /// Adds `blocks` when they fit (giving up prefix-cache entries if
    /// needed); false when the pool is full.
    pub try_reserve: unsafe extern "C" fn(ctx: *mut c_void, blocks: usize) -> bool,
    pub release: unsafe extern "C" fn(ctx: *mut c_void, blocks: usize),
    /// Blocks held by sequences (not the prefix cache's).
    pub allocated: unsafe extern "C" fn(ctx: *mut c_void) -> usize,
}

/// Waiting on the KV pool's count (`kv_pool::Ledger`'s `releases`,
/// `wait_release`, `wake`), for an engine that queues while it is full.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RawKvWaits {
    pub ctx: *mut c_void,
    pub releases: unsafe extern "C" fn(ctx: *mut c_void) -> u64,
    /// Returns once `releases` is past `seen`.
    pub wait: unsafe extern "C" fn(ctx: *mut c_void, seen: u64),
    pub wake: unsafe extern "C" fn(ctx: *mut c_void),
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
    pub request: RawRequest,
    pub cancel: RawCancel,
    pub events: RawEventSink,
    /// Lent for the call.
    pub cache: RawKv,
    pub last_token: u32,
    /// Tokens streamed so far (`last_token` included).
    pub generated: *const u32,
    pub generated_len: usize,
    pub cached_tokens: u32,
    pub reserved_blocks: usize,
}

/// A `KvCache` in C form. Per layer its storage format and
/// [`KV_BUFFERS`] handle slots: its buffers (`cache::contiguous`), null past
/// its last one and for a layer not yet written (or one that reads another
/// layer's keys and values). Per layer also two slots for a
/// linear-attention layer's recurrent state (convolution inputs,
/// delta-rule state), null for other layers.
#[repr(C)]
pub struct RawKv {
    pub formats: *mut RawKvFormat,
    pub buffers: *mut mlx_array,
    pub recurrent: *mut mlx_array,
    pub layers: usize,
    pub len: i32,
    pub capacity: i32,
    pub left_pad: *const i32,
    pub batch: usize,
    /// A paged cache (batch 1): the ids of its row's blocks in the host's
    /// pool, in order (each one count the receiver then holds, or lent
    /// with the cache); `buffers` then hold nothing. `blocks_cap`: room a
    /// receiver has.
    pub blocks: *mut u32,
    pub blocks_len: usize,
    pub blocks_cap: usize,
}

/// A layer's storage in a [`RawKv`]: `bits` 0 for the activations'
/// dtype, else quantized with `bits` and `group_size`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawKvFormat {
    pub bits: i32,
    pub group_size: i32,
}

/// Handle slots per layer in [`RawKv::buffers`]: the most buffers a
/// layer has (quantized keys and values: codes, scales, biases each).
pub const KV_BUFFERS: usize = 6;

impl RawKvFormat {
    pub(crate) fn of(quant: Option<KvQuant>) -> Self {
        match quant {
            None => Self {
                bits: 0,
                group_size: 0,
            },
            Some(q) => Self {
                bits: q.bits,
                group_size: q.group_size,
            },
        }
    }

    pub(crate) fn quant(self) -> Option<KvQuant> {
        (self.bits != 0).then_some(KvQuant {
            bits: self.bits,
            group_size: self.group_size,
        })
    }
}

/// The shared prefix cache (`prefix_cache::SharedPrefixCache`). Scopes are
/// UTF-8 bytes (`scoped` false: no scope), token sequences the bytes of
/// their u32s.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawPrefixCache {
    pub ctx: *mut c_void,
    /// Tokens per block; entries are block-aligned.
    pub block: usize,
    /// Entries kept at most (0: disabled).
    pub capacity: usize,
    /// Entries are recurrent-state snapshots, reused whole.
    pub exact: bool,
    /// Length of the longest reusable prefix of `prompt`, 0 when none;
    /// on a hit its KV is written to `out` (the caller's buffers of
    /// `out.layers` handles), each handle then owned by the caller.
    pub lookup: unsafe extern "C" fn(
        ctx: *mut c_void,
        scope: Bytes,
        scoped: bool,
        prompt: Bytes,
        out: *mut RawKv,
    ) -> usize,
    pub has_hit:
        unsafe extern "C" fn(ctx: *mut c_void, scope: Bytes, scoped: bool, prompt: Bytes) -> bool,
    /// Keeps the block-aligned prefix of `tokens`; `kv` is only lent.
    pub insert: unsafe extern "C" fn(
        ctx: *mut c_void,
        scope: Bytes,
        scoped: bool,
        tokens: Bytes,
        kv: *const RawKv,
    ),
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

#[cfg(test)]
mod tests {
    use std::mem::offset_of;

    use super::*;

    /// Where shared-state v1's members stand. An addition at
    /// [`RawShared`]'s end leaves these as they are; any other change
    /// moves them: that is a new shared-state version in
    /// [`MLX_FINGERPRINT`] and new numbers here.
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn the_tables_keep_their_versions_layout() {
        assert!(mlx_fingerprint().ends_with(", shared state v3"));
        macro_rules! at {
            ($t:ty: $($f:ident),*) => { [$(offset_of!($t, $f)),*] };
        }
        assert_eq!(
            at!(RawShared: size, mlx, model_path, model_name, compute_dtype, kv_cache, arrays,
                arrays_len, device, kv, handover, prefix, pages, kv_waits),
            [0, 8, 16, 24, 32, 40, 48, 56, 64, 88, 160, 184, 240, 248]
        );
        assert_eq!(at!(RawKvWaits: ctx, releases, wait, wake), [0, 8, 16, 24]);
        assert_eq!(
            at!(RawPagePool: ctx, key, block, blocks, layers, allocate, retain, release, holders,
                free_blocks, buffers, state, write, copy_block, mark_written),
            [0, 8, 16, 20, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104]
        );
        assert_eq!(at!(RawDeviceLock: ctx, lock, unlock), [0, 8, 16]);
        assert_eq!(
            at!(RawKvLedger: ctx, total, block_size, bytes_per_block, state_blocks, step_tokens,
                try_reserve, release, allocated),
            [0, 8, 16, 24, 32, 40, 48, 56, 64]
        );
        assert_eq!(at!(RawHandoverSlot: ctx, set, get), [0, 8, 16]);
        assert_eq!(at!(RawHandoverSink: ctx, adopt, busy), [0, 8, 16]);
        assert_eq!(
            at!(RawHandover: request, cancel, events, cache, last_token, generated,
                generated_len, cached_tokens, reserved_blocks),
            [0, 32, 64, 104, 184, 192, 200, 208, 216]
        );
        assert_eq!(
            at!(RawKv: formats, buffers, recurrent, layers, len, capacity, left_pad, batch,
                blocks, blocks_len, blocks_cap),
            [0, 8, 16, 24, 32, 36, 40, 48, 56, 64, 72]
        );
        assert_eq!(at!(RawKvFormat: bits, group_size), [0, 4]);
        assert_eq!(
            at!(RawPrefixCache: ctx, block, capacity, exact, lookup, has_hit, insert),
            [0, 8, 16, 24, 32, 40, 48]
        );
    }
}
