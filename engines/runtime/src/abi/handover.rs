//! A running sequence across the boundary ([`RawHandover`]): the sink that
//! adopts it, exported as a C handle ([`sink`]) and called through one
//! ([`ForeignSink`]).

use std::ffi::c_void;
use std::sync::Arc;

use engine_core::plugin::wire::{read_request, LentRequest};
use engine_core::{CancelToken, EventSender};

use super::{ctx, guard, leak, LentKv, RawHandover, RawHandoverSink};
use crate::handover::{Handover, HandoverSink};
use crate::kv_pool::KvPool;
use crate::paged::PagePool;

/// What an exported sink's functions reach: the sink, and the pools its
/// adopted blocks belong to.
struct SinkCtx {
    sink: Arc<dyn HandoverSink>,
    pool: KvPool,
    pages: Option<PagePool>,
}

/// `sink` as a C handle.
pub(crate) fn sink(
    sink: Arc<dyn HandoverSink>,
    pool: KvPool,
    pages: Option<PagePool>,
) -> RawHandoverSink {
    unsafe extern "C" fn adopt(c: *mut c_void, raw: *const RawHandover) -> bool {
        guard(false, || {
            let c = ctx::<SinkCtx>(c);
            let Some(handover) = handover(&*raw, &c.pool, c.pages.as_ref()) else {
                return false;
            };
            match c.sink.adopt(handover) {
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
        })
    }
    unsafe extern "C" fn busy(c: *mut c_void) -> bool {
        guard(false, || ctx::<SinkCtx>(c).sink.busy())
    }
    RawHandoverSink {
        ctx: leak(SinkCtx { sink, pool, pages }),
        adopt,
        busy,
    }
}

/// A handover sink registered through C (by another image).
pub(crate) struct ForeignSink(pub(crate) RawHandoverSink);

unsafe impl Send for ForeignSink {}
unsafe impl Sync for ForeignSink {}

impl HandoverSink for ForeignSink {
    fn adopt(&self, h: Handover) -> Result<(), Box<Handover>> {
        let Ok(request) = LentRequest::new(&h.request) else {
            return Err(Box::new(h));
        };
        let lent = LentKv::new(&h.cache);
        let raw = RawHandover {
            request: request.raw(),
            cancel: h.request.cancel.clone().into_raw(),
            events: h.events.clone().into_raw(),
            cache: lent.raw(),
            last_token: h.last_token,
            generated: h.generated.as_ptr(),
            generated_len: h.generated.len(),
            cached_tokens: h.cached_tokens,
            reserved_blocks: h.reservation.blocks(),
        };
        // SAFETY: the sink lives for the process; `raw` outlives the call.
        if unsafe { (self.0.adopt)(self.0.ctx, &raw) } {
            drop((lent, request));
            // The adopter holds the blocks now.
            h.reservation.into_blocks();
            return Ok(());
        }
        unsafe {
            (raw.cancel.release)(raw.cancel.ctx);
            (raw.events.release)(raw.events.ctx);
        }
        drop((lent, request));
        Err(Box::new(h))
    }

    fn busy(&self) -> bool {
        unsafe { (self.0.busy)(self.0.ctx) }
    }
}

/// The sequence a [`RawHandover`] describes, its handles now ours (the
/// cache's retained from `pages`, the blocks adopted into `pool`).
///
/// # Safety
/// `raw` is live for the call and its handles are the receiver's to take.
unsafe fn handover(raw: &RawHandover, pool: &KvPool, pages: Option<&PagePool>) -> Option<Handover> {
    let mut request = read_request(&raw.request).ok()?;
    let cache = raw.cache.retained(pages).ok()?;
    request.cancel = CancelToken::from_raw(std::ptr::read(&raw.cancel));
    Some(Handover {
        request,
        cache,
        last_token: raw.last_token,
        generated: std::slice::from_raw_parts(raw.generated, raw.generated_len).to_vec(),
        cached_tokens: raw.cached_tokens,
        reservation: pool.adopt(raw.reserved_blocks),
        events: EventSender::from_raw(std::ptr::read(&raw.events)),
    })
}
