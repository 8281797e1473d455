//! Moving a running sequence from one engine to another without recomputing
//! its prefix: the fast path hands its request, KV cache and KV reservation
//! to the batched engine when a second request arrives, and the client's
//! stream continues uninterrupted. Across plugins the sequence travels as
//! `abi::RawHandover` (the KV arrays as mlx-c handles).

use std::sync::{Arc, RwLock};

use engine_core::event::EventSender;
use engine_core::{Event, GenerateRequest, StreamError};

use crate::cache::KvCache;
use crate::emit::Emitter;
use crate::kv_pool::Reservation;

pub struct Handover {
    pub request: GenerateRequest,
    /// KV of the prompt and every generated token except `last_token`.
    pub cache: KvCache,
    /// The newest token: already streamed to the client, not yet fed to the
    /// model.
    pub last_token: u32,
    /// Tokens streamed so far, in order (`last_token` included).
    pub generated: Vec<u32>,
    pub cached_tokens: u32,
    pub reservation: Reservation,
    pub events: EventSender,
}

impl Handover {
    /// The sequence `out` streams, its KV (`cache`: every position before
    /// `last_token`) and its blocks.
    pub fn of(out: Emitter, cache: KvCache, last_token: u32, reservation: Reservation) -> Self {
        let (request, events, generated, cached_tokens) = out.into_parts();
        Self {
            request,
            cache,
            last_token,
            generated,
            cached_tokens,
            reservation,
            events,
        }
    }

    /// Gives the sequence to `sink`; one it cannot take ends the client's
    /// stream with an error. Returns whether it was taken.
    pub fn give_to(self, sink: &dyn HandoverSink) -> bool {
        match sink.adopt(self) {
            Ok(()) => true,
            Err(h) => {
                let _ = h.events.send(Event::Error(StreamError::Internal(
                    "generation could not continue".into(),
                )));
                false
            }
        }
    }
}

/// An engine that can adopt running sequences.
pub trait HandoverSink: Send + Sync {
    /// Takes the sequence over, or gives it back when it cannot.
    fn adopt(&self, handover: Handover) -> Result<(), Box<Handover>>;
    /// Whether the sink has work of its own (running or waiting): the
    /// moment an exclusive engine should hand its sequence over.
    fn busy(&self) -> bool;
}

/// Where the engine that adopts handed-over sequences registers: the
/// host's [`LocalSlot`], or the host's through C in a plugin
/// (`abi::foreign`).
pub trait HandoverSlot: Send + Sync {
    fn set(&self, sink: Arc<dyn HandoverSink>);
    fn get(&self) -> Option<Arc<dyn HandoverSink>>;
}

/// The host's slot.
#[derive(Default)]
pub struct LocalSlot(RwLock<Option<Arc<dyn HandoverSink>>>);

impl HandoverSlot for LocalSlot {
    fn set(&self, sink: Arc<dyn HandoverSink>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Some(sink);
    }

    fn get(&self) -> Option<Arc<dyn HandoverSink>> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}
