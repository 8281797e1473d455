//! Event senders and cancel tokens as C handles and back. A handle made by
//! `into_raw` wraps the Rust value with this image's functions; one taken
//! by `from_raw` is the foreign side of [`EventSink`] and [`CancelFlag`]:
//! it calls the other image's functions and releases the handle when
//! dropped. Tokens cross as [`RawToken`]s; other events as JSON.

use std::ffi::c_void;
use std::future::Future;
use std::pin::Pin;

use super::abi::{Bytes, RawCancel, RawEventSink, RawToken};
use crate::event::{Event, EventSender, EventSink, TokenEvent};
use crate::request::{CancelFlag, CancelToken};

struct ForeignEvents(RawEventSink);

// The host's sink is thread-safe (a tokio channel behind C functions).
unsafe impl Send for ForeignEvents {}
unsafe impl Sync for ForeignEvents {}

impl EventSink for ForeignEvents {
    fn send(&self, event: Event) -> Result<(), Event> {
        // SAFETY: the handle is live until drop; the arrays outlive the call.
        let sent = match &event {
            Event::Token(t) => {
                let (ids, logprobs): (Vec<u32>, Vec<f32>) = t.top_logprobs.iter().copied().unzip();
                let raw = RawToken {
                    id: t.id,
                    has_logprob: t.logprob.is_some(),
                    logprob: t.logprob.unwrap_or(0.0),
                    top_ids: ids.as_ptr(),
                    top_logprobs: logprobs.as_ptr(),
                    top_len: ids.len(),
                };
                unsafe { (self.0.send_token)(self.0.ctx, &raw) }
            }
            other => match serde_json::to_vec(other) {
                Ok(json) => unsafe { (self.0.send)(self.0.ctx, Bytes::new(&json)) },
                Err(_) => false,
            },
        };
        sent.then_some(()).ok_or(event)
    }

    fn is_closed(&self) -> bool {
        unsafe { (self.0.is_closed)(self.0.ctx) }
    }

    /// A C sink cannot wake a future; it is polled.
    fn closed(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            while !self.is_closed() {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        })
    }
}

impl Drop for ForeignEvents {
    fn drop(&mut self) {
        unsafe { (self.0.release)(self.0.ctx) }
    }
}

struct ForeignCancel(RawCancel);

unsafe impl Send for ForeignCancel {}
unsafe impl Sync for ForeignCancel {}

impl CancelFlag for ForeignCancel {
    fn cancel(&self) {
        unsafe { (self.0.cancel)(self.0.ctx) }
    }

    fn is_cancelled(&self) -> bool {
        unsafe { (self.0.is_cancelled)(self.0.ctx) }
    }
}

impl Drop for ForeignCancel {
    fn drop(&mut self) {
        unsafe { (self.0.release)(self.0.ctx) }
    }
}

/// # Safety
/// `raw`'s arrays hold `top_len` values each.
unsafe fn token_of(raw: &RawToken) -> TokenEvent {
    let (ids, logprobs) = match raw.top_len {
        0 => (&[][..], &[][..]),
        n => (
            std::slice::from_raw_parts(raw.top_ids, n),
            std::slice::from_raw_parts(raw.top_logprobs, n),
        ),
    };
    TokenEvent {
        id: raw.id,
        logprob: raw.has_logprob.then_some(raw.logprob),
        top_logprobs: ids.iter().copied().zip(logprobs.iter().copied()).collect(),
    }
}

impl EventSender {
    /// A C handle that sends through this sender (it keeps the sender alive
    /// until released).
    pub fn into_raw(self) -> RawEventSink {
        unsafe extern "C" fn send_token(ctx: *mut c_void, token: *const RawToken) -> bool {
            let sender = &*(ctx as *const EventSender);
            sender.send(Event::Token(token_of(&*token))).is_ok()
        }
        unsafe extern "C" fn send(ctx: *mut c_void, event: Bytes) -> bool {
            let sender = &*(ctx as *const EventSender);
            let parsed = serde_json::from_slice::<Event>(event.as_slice());
            match parsed {
                Ok(event) => sender.send(event).is_ok(),
                Err(e) => {
                    tracing::error!(error = %e, "an engine sent an event that does not parse; dropping the request's stream");
                    false
                }
            }
        }
        unsafe extern "C" fn is_closed(ctx: *mut c_void) -> bool {
            (*(ctx as *const EventSender)).is_closed()
        }
        unsafe extern "C" fn release(ctx: *mut c_void) {
            drop(Box::from_raw(ctx as *mut EventSender));
        }
        RawEventSink {
            ctx: Box::into_raw(Box::new(self)) as *mut c_void,
            send_token,
            send,
            is_closed,
            release,
        }
    }

    /// # Safety
    /// `raw` is a live handle this side now owns.
    pub unsafe fn from_raw(raw: RawEventSink) -> Self {
        EventSender::new(ForeignEvents(raw))
    }
}

impl CancelToken {
    /// A C handle that reads and sets this token.
    pub fn into_raw(self) -> RawCancel {
        unsafe extern "C" fn is_cancelled(ctx: *mut c_void) -> bool {
            (*(ctx as *const CancelToken)).is_cancelled()
        }
        unsafe extern "C" fn cancel(ctx: *mut c_void) {
            (*(ctx as *const CancelToken)).cancel()
        }
        unsafe extern "C" fn release(ctx: *mut c_void) {
            drop(Box::from_raw(ctx as *mut CancelToken));
        }
        RawCancel {
            ctx: Box::into_raw(Box::new(self)) as *mut c_void,
            is_cancelled,
            cancel,
            release,
        }
    }

    /// # Safety
    /// `raw` is a live handle this side now owns.
    pub unsafe fn from_raw(raw: RawCancel) -> Self {
        CancelToken::with_flag(ForeignCancel(raw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{event_channel, Finish, FinishReason};

    #[test]
    fn events_and_cancellation_round_trip_through_c_handles() {
        let (tx, mut rx) = event_channel();
        let far = unsafe { EventSender::from_raw(tx.into_raw()) };
        let token = CancelToken::new();
        let far_token = unsafe { CancelToken::from_raw(token.clone().into_raw()) };
        let event = Event::Token(TokenEvent {
            id: 7,
            logprob: Some(-0.5),
            top_logprobs: vec![(7, -0.5), (3, -1.25)],
        });
        // A token the sampler ruled out has a log-probability of -inf,
        // which JSON could not carry; one without logprobs has none.
        let ruled_out = Event::Token(TokenEvent {
            id: 3,
            logprob: Some(f32::NEG_INFINITY),
            top_logprobs: vec![(3, f32::NEG_INFINITY)],
        });
        let plain = Event::Token(TokenEvent {
            id: 4,
            logprob: None,
            top_logprobs: Vec::new(),
        });
        let finished = Event::Finished(Finish {
            reason: FinishReason::Length,
            prompt_tokens: 2,
            completion_tokens: 3,
            cached_tokens: 0,
            spec: None,
        });
        for e in [&event, &ruled_out, &plain, &finished] {
            far.send(e.clone()).unwrap();
            assert_eq!(&rx.try_recv().unwrap(), e);
        }
        far_token.cancel();
        assert!(token.is_cancelled());
        assert!(!far.is_closed());
        drop(rx);
        assert!(far.is_closed());
        assert!(far.send(event).is_err());
        // Dropping the last far sender closes the stream for a receiver.
        let (tx, mut rx) = event_channel();
        drop(unsafe { EventSender::from_raw(tx.into_raw()) });
        assert!(rx.try_recv().is_err() && rx.is_closed());
    }
}
