//! Requests waiting for a batch slot or KV blocks, first come first served.

use std::collections::VecDeque;

use engine_core::event::EventSender;
use engine_core::GenerateRequest;

pub struct Waiting {
    pub request: GenerateRequest,
    pub blocks: usize,
    pub events: EventSender,
}

pub struct WaitQueue {
    items: VecDeque<Waiting>,
    capacity: usize,
}

impl WaitQueue {
    pub fn new(capacity: usize) -> Self {
        Self {
            items: VecDeque::new(),
            capacity,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Gives the request back when the queue is full.
    pub fn push(&mut self, w: Waiting) -> Result<(), Waiting> {
        if self.items.len() >= self.capacity {
            return Err(w);
        }
        self.items.push_back(w);
        Ok(())
    }

    pub fn front(&self) -> Option<&Waiting> {
        self.items.front()
    }

    pub fn pop(&mut self) -> Option<Waiting> {
        self.items.pop_front()
    }

    /// Removes requests that were cancelled while waiting.
    pub fn drain_cancelled(&mut self) -> Vec<Waiting> {
        let (gone, keep): (Vec<_>, Vec<_>) = self
            .items
            .drain(..)
            .partition(|w| w.request.cancel.is_cancelled() || w.events.is_closed());
        self.items = keep.into();
        gone
    }

    pub fn drain(&mut self) -> impl Iterator<Item = Waiting> + '_ {
        self.items.drain(..)
    }
}
