//! Requests waiting for a batch slot or KV blocks, first come first served.
//! Its bound is the engine's queue length, checked at submit.

use std::collections::VecDeque;

use engine_core::event::EventSender;
use engine_core::{FinishReason, GenerateRequest};
use runtime::emit::Emitter;
use runtime::worker::CancelGuard;

pub struct Waiting {
    pub request: GenerateRequest,
    pub blocks: usize,
    pub events: EventSender,
    /// Its place among the worker's cancel handles, taken when the
    /// scheduler receives it: the request leaves them when it ends,
    /// waiting or running.
    pub cancel_handle: Option<CancelGuard>,
}

impl Waiting {
    /// Cancelled, or its client left.
    pub fn is_cancelled(&self) -> bool {
        self.request.cancel.is_cancelled() || self.events.is_closed()
    }

    /// Ends it before it ran (cancelled, or the engine stops).
    pub fn cancel(self) {
        Emitter::new(self.request, self.events).finish(FinishReason::Cancelled, None);
    }
}

#[derive(Default)]
pub struct WaitQueue {
    items: VecDeque<Waiting>,
}

impl WaitQueue {
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn push(&mut self, w: Waiting) {
        self.items.push_back(w);
    }

    pub fn front(&self) -> Option<&Waiting> {
        self.items.front()
    }

    /// Front to back.
    pub fn iter(&self) -> impl Iterator<Item = &Waiting> {
        self.items.iter()
    }

    pub fn pop(&mut self) -> Option<Waiting> {
        self.items.pop_front()
    }

    /// Removes requests that were cancelled while waiting.
    pub fn drain_cancelled(&mut self) -> Vec<Waiting> {
        let (gone, keep): (Vec<_>, Vec<_>) = self.items.drain(..).partition(Waiting::is_cancelled);
        self.items = keep.into();
        gone
    }

    pub fn drain(&mut self) -> impl Iterator<Item = Waiting> + '_ {
        self.items.drain(..)
    }
}
