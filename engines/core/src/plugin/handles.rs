//! Event senders and cancel tokens as C handles and back. A handle made by
//! `into_raw` wraps the Rust value with this image's functions; one taken
//! by `from_raw` calls the other image's functions and releases the handle
//! when dropped.

use std::ffi::c_void;
use std::sync::Arc;

use tokio::sync::mpsc::error::SendError;

use super::abi::{Bytes, RawCancel, RawEventSink};
use crate::event::{Event, EventSender, Sink};
use crate::request::{CancelToken, Flag};

pub struct ForeignEvents(RawEventSink);

// The host's sink is thread-safe (a tokio channel behind C functions).
unsafe impl Send for ForeignEvents {}
unsafe impl Sync for ForeignEvents {}

impl ForeignEvents {
    pub(crate) fn send(&self, event: Event) -> Result<(), SendError<Event>> {
        let Ok(json) = serde_json::to_vec(&event) else {
            return Err(SendError(event));
        };
        // SAFETY: the handle is live until drop.
        if unsafe { (self.0.send)(self.0.ctx, Bytes::new(&json)) } {
            Ok(())
        } else {
            Err(SendError(event))
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        unsafe { (self.0.is_closed)(self.0.ctx) }
    }
}

impl Drop for ForeignEvents {
    fn drop(&mut self) {
        unsafe { (self.0.release)(self.0.ctx) }
    }
}

pub struct ForeignCancel(RawCancel);

unsafe impl Send for ForeignCancel {}
unsafe impl Sync for ForeignCancel {}

impl ForeignCancel {
    pub(crate) fn cancel(&self) {
        unsafe { (self.0.cancel)(self.0.ctx) }
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        unsafe { (self.0.is_cancelled)(self.0.ctx) }
    }
}

impl Drop for ForeignCancel {
    fn drop(&mut self) {
        unsafe { (self.0.release)(self.0.ctx) }
    }
}

impl EventSender {
    /// A C handle that sends through this sender (it keeps the sender alive
    /// until released).
    pub fn into_raw(self) -> RawEventSink {
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
            send,
            is_closed,
            release,
        }
    }

    /// # Safety
    /// `raw` is a live handle this side now owns.
    pub unsafe fn from_raw(raw: RawEventSink) -> Self {
        EventSender(Sink::Foreign(Arc::new(ForeignEvents(raw))))
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
        CancelToken(Flag::Foreign(Arc::new(ForeignCancel(raw))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{event_channel, TokenEvent};

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
        far.send(event.clone()).unwrap();
        assert_eq!(rx.try_recv().unwrap(), event);
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
