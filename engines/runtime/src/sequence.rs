//! One sequence's life, the same in every engine: started with its sampler
//! and its compiled grammar, its prompt prefilled after the prefix cache's
//! longest hit in chunks that follow one rule ([`Prefill`]) and kept there
//! for the requests that share it, each chosen token taken through one rule
//! (the grammar's end, the penalties, the [`Emitter`]'s stop tokens,
//! cancellation and `max_tokens`, then the grammar's commit), and ended by
//! giving back its KV blocks and engine slot before the final event, or
//! handed over to another engine with them. Engines keep only what their
//! forwards need (a batch row, a cache, drafts) beside it.

use std::convert::Infallible;
use std::time::Instant;

use engine_core::event::EventSender;
use engine_core::{FinishReason, GenerateRequest, SpecStats, StreamError, TokenEvent};
use grammar::Constraint;
use mlx_rs::transforms::eval;
use mlx_rs::Array;

use crate::cache::KvCache;
use crate::emit::Emitter;
use crate::generate::{self, DecodeStream};
use crate::handover::{Handover, HandoverSink};
use crate::kv_pool::Reservation;
use crate::model::Logits;
use crate::sampling::{self, Pick, Sampler};
use crate::shared::SharedModel;

pub struct Sequence {
    pub out: Emitter,
    /// The request's sampling (greedy included).
    pub sampler: Sampler,
    /// The request's grammar state (structured outputs).
    pub constraint: Option<Constraint>,
    /// Its KV blocks, until it ends or is handed over.
    reservation: Option<Reservation>,
    /// What else it holds in its engine (a slot, a place in a count),
    /// given back with the blocks.
    held: Vec<Box<dyn Send>>,
}

impl Sequence {
    /// Starts a request holding `reservation`: its sampler, and its
    /// grammar compiled by `compile`. A request whose sampling or grammar
    /// is invalid ends here with the client's error (`None`).
    pub fn start(
        request: GenerateRequest,
        events: EventSender,
        reservation: Reservation,
        vocab: i32,
        compile: impl FnOnce(&engine_core::Grammar) -> Result<Constraint, String>,
    ) -> Option<Self> {
        let mut out = Emitter::new(request, events);
        let id = out.request.id;
        let sampler = match Sampler::new(&out.request.sampling, vocab, &out.request.prompt) {
            Ok(s) => s,
            Err(e) => {
                drop(reservation);
                out.fail(StreamError::Invalid(format!(
                    "{id}: invalid sampling parameters: {e}"
                )));
                return None;
            }
        };
        let constraint = match out.request.grammar.as_ref().map(compile).transpose() {
            Ok(c) => c,
            Err(e) => {
                drop(reservation);
                out.fail(StreamError::Invalid(format!("{id}: {e}")));
                return None;
            }
        };
        Some(Self {
            out,
            sampler,
            constraint,
            reservation: Some(reservation),
            held: Vec::new(),
        })
    }

    /// [`Sequence::start`] with the grammar compiled by the shared model's
    /// compiler.
    pub fn start_on(
        shared: &SharedModel,
        request: GenerateRequest,
        events: EventSender,
        reservation: Reservation,
    ) -> Option<Self> {
        let vocab = shared.model.vocab_size() as i32;
        Self::start(request, events, reservation, vocab, |g| {
            shared
                .grammars()
                .and_then(|c| c.compile(g).map_err(|e| e.0))
        })
    }

    /// Continues a sequence another engine started; returns it with its
    /// cache and its newest token (streamed, not yet fed). Its sampler
    /// moves past the tokens drawn so far, so penalties count them and a
    /// seeded request goes on with the draws plain sampling would make. A
    /// constrained sequence cannot continue (its grammar's state stays
    /// with the engine that started it): `None`, its stream ended.
    pub fn resume(h: Handover, vocab: i32) -> Option<(Self, KvCache, u32)> {
        let mut out = Emitter::resume(h.request, h.events, h.generated, h.cached_tokens);
        let sampler = Sampler::new(&out.request.sampling, vocab, &out.request.prompt)
            .and_then(|mut s| s.advance(out.delivered()).map(|()| s));
        let error = match sampler {
            Err(e) => format!("cannot continue the request: {e}"),
            // See `can_hand_over`.
            Ok(_) if out.request.grammar.is_some() => {
                "a constrained sequence cannot be handed over".into()
            }
            Ok(sampler) => {
                let seq = Self {
                    out,
                    sampler,
                    constraint: None,
                    reservation: Some(h.reservation),
                    held: Vec::new(),
                };
                return Some((seq, h.cache, h.last_token));
            }
        };
        drop(h.reservation);
        out.fail(StreamError::Internal(error));
        None
    }

    /// Holds `thing` until the sequence ends or is handed over (it is
    /// given back with the KV blocks, before the final event).
    pub fn hold(&mut self, thing: impl Send + 'static) {
        self.held.push(Box::new(thing));
    }

    pub fn request(&self) -> &GenerateRequest {
        &self.out.request
    }

    /// KV blocks it holds.
    pub fn blocks(&self) -> usize {
        self.reservation.as_ref().map_or(0, Reservation::blocks)
    }

    /// The per-token rule: takes a chosen token (`grammar_over`: the
    /// grammar allowed nothing at its position) and returns why the
    /// sequence ends, if it does. A constrained sequence ends with `Stop`
    /// where its grammar is complete, allows nothing more or chose an
    /// end-of-sequence token (that token not streamed); otherwise the
    /// penalties count the token, the [`Emitter`] streams it (or ends at a
    /// stop token, cancellation or `max_tokens`) and the grammar follows
    /// it. The caller then publishes what it wants and calls
    /// [`Sequence::finish`].
    pub fn accept(
        &mut self,
        token: TokenEvent,
        grammar_over: bool,
    ) -> anyhow::Result<Option<FinishReason>> {
        let id = token.id;
        if grammar_over || self.constraint.as_ref().is_some_and(|c| c.is_end(id)) {
            return Ok(Some(FinishReason::Stop));
        }
        self.sampler.observe(id)?;
        if let Some(reason) = self.out.token(token) {
            return Ok(Some(reason));
        }
        let broke = self.constraint.as_mut().is_some_and(|c| !c.commit(id));
        Ok(broke.then_some(FinishReason::Stop))
    }

    /// [`Sequence::accept`] for a token without logprobs.
    pub fn accept_plain(
        &mut self,
        id: u32,
        grammar_over: bool,
    ) -> anyhow::Result<Option<FinishReason>> {
        let token = TokenEvent {
            id,
            logprob: None,
            top_logprobs: Vec::new(),
        };
        self.accept(token, grammar_over)
    }

    /// Plain greedy sequences share one argmax; a constrained one picks
    /// under its own mask.
    pub fn plain_greedy(&self) -> bool {
        self.constraint.is_none() && self.out.request.is_plain_greedy()
    }

    pub fn wants_logprobs(&self) -> bool {
        self.out.request.sampling.logprobs
    }

    /// Whether its next pick can be built before its current token is read
    /// on the host (pipelined decode): not under a grammar, whose mask
    /// follows the token, nor with penalties, which count it.
    pub fn pipelines(&self) -> bool {
        self.constraint.is_none() && !self.sampler.reads_history()
    }

    /// Tokens it may still emit before `max_tokens`.
    pub fn tokens_left(&self) -> u32 {
        self.request()
            .max_tokens
            .saturating_sub(self.out.generated())
    }

    /// What its KV holds while it decodes: the prompt and every delivered
    /// token but the newest, which is the next input.
    pub fn context(&self) -> Vec<u32> {
        let fed = self.out.delivered().len().saturating_sub(1);
        [
            self.request().prompt.as_slice(),
            &self.out.delivered()[..fed],
        ]
        .concat()
    }

    /// `context().len()`, without building it.
    pub fn context_len(&self) -> usize {
        self.request().prompt.len() + self.out.delivered().len().saturating_sub(1)
    }

    pub fn is_cancelled(&self) -> bool {
        self.out.is_cancelled()
    }

    /// The longest prefix of its prompt that `shared`'s prefix cache
    /// keeps, as a cache to prefill the rest into, and its length (the
    /// usage reports those tokens as cached); an empty cache and 0 when
    /// none is kept.
    pub fn cached_prefix(&mut self, shared: &SharedModel) -> (KvCache, usize) {
        let (scope, prompt) = (
            self.request().cache_scope.as_deref(),
            &self.request().prompt,
        );
        let layers = shared.model.model.num_layers();
        let (cache, tokens) = match shared.prefix.lookup(scope, prompt, layers) {
            Some(hit) => (hit.cache, hit.tokens),
            None => (shared.new_cache(vec![0]), 0),
        };
        self.out.set_cached_tokens(tokens as u32);
        (cache, tokens)
    }

    /// Prefills its prompt into `cache`, which holds its first `done`
    /// tokens (from [`Sequence::cached_prefix`]): chunks of
    /// `shared.prefill_chunk()` tokens by [`Prefill::chunk_end`]'s rule,
    /// each run by `forward(cache, tokens, last)`, the cache evaluated
    /// between them so no chunk's graph holds the one before; the
    /// snapshot point and then the whole prompt kept in the prefix cache
    /// for requests that share them. Returns the last chunk's output.
    /// Under the device lock.
    pub fn prefill<T>(
        &self,
        shared: &SharedModel,
        cache: &mut KvCache,
        done: usize,
        mut forward: impl FnMut(&mut KvCache, &[u32], bool) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let prompt = self.request().prompt.clone();
        let snapshot = shared.prefix.snapshot_at(prompt.len());
        let mut at = Prefill::new(done, prompt.len(), snapshot);
        let mut last = None;
        while !at.is_done() {
            let end = at.chunk_end(self.request(), shared.prefill_chunk());
            let out = forward(cache, &prompt[at.done..end], end == prompt.len())?;
            if end < prompt.len() {
                eval(&cache.state())?;
            }
            if at.advance(end) {
                self.publish(shared, &prompt[..end], cache);
            }
            last = Some(out);
        }
        let last = last.ok_or_else(|| anyhow::anyhow!("empty prompt"))?;
        self.publish(shared, &prompt, cache);
        Ok(last)
    }

    /// Its prompt prefilled after the prefix cache's longest hit (and kept
    /// there) and its first token queued: the stream to decode from. The
    /// first token is queued before the prompt is published, so the device
    /// computes it meanwhile. Under the device lock.
    pub fn prefill_stream<'m>(
        &mut self,
        shared: &'m SharedModel,
    ) -> anyhow::Result<DecodeStream<'m>> {
        let model = &shared.model.model;
        let (mut cache, done) = self.cached_prefix(shared);
        let pick = self.next_pick();
        let first = self.prefill(shared, &mut cache, done, |cache, tokens, last| {
            let logits =
                generate::prefill_chunk(model, cache, tokens, shared.prefill_chunk(), last)?;
            match last {
                true => self.queue_token(&logits, pick),
                false => Ok(logits),
            }
        })?;
        Ok(DecodeStream::queued(model, cache, first))
    }

    /// How its next token is chosen, the draw taken: `None` for a plain
    /// greedy sequence (the argmax), else its sampler's pick.
    fn next_pick(&mut self) -> Option<Pick> {
        (!self.plain_greedy()).then(|| self.sampler.next_pick())
    }

    /// Its token from `[1, 1, V]` logits as `pick` ([`Sequence::next_pick`])
    /// chooses it, `[1, 1]` int32, queued.
    fn queue_token(&self, logits: &Array, pick: Option<Pick>) -> anyhow::Result<Array> {
        match pick {
            None => generate::queue_argmax(logits),
            Some(pick) => generate::queue_pick(&self.sampler, pick, logits),
        }
    }

    /// Decoding to its end ([`Sequence::decode_until`], never paused),
    /// `after_token` run after each token that does not end it. Under the
    /// device lock.
    pub fn decode(
        &mut self,
        shared: &SharedModel,
        mut after_token: impl FnMut(),
    ) -> anyhow::Result<FinishReason> {
        let mut first = true;
        let decoded = self.decode_until(shared, || {
            if !std::mem::take(&mut first) {
                after_token();
            }
            None::<Infallible>
        })?;
        Ok(match decoded {
            Decoded::Finished(reason) => reason,
            Decoded::Paused { with, .. } => match with {},
        })
    }

    /// Pipelined decoding ([`Sequence::pipelines`]: greedy or sampled, no
    /// grammar or penalties) that another engine may take over:
    /// [`Sequence::prefill_stream`], then each token read and
    /// [`Sequence::accept`]ed, the step after it queued first. Before each
    /// token is read `pause` is asked; where it answers `Some`, no step is
    /// queued after that token and, unless the token ends the sequence,
    /// decoding stops there ([`Decoded::Paused`], for
    /// [`Sequence::hand_over`]). The prompt and the answer are kept in the
    /// prefix cache before either ([`Sequence::publish_answer`]). Under the
    /// device lock.
    pub fn decode_until<T>(
        &mut self,
        shared: &SharedModel,
        mut pause: impl FnMut() -> Option<T>,
    ) -> anyhow::Result<Decoded<T>> {
        anyhow::ensure!(
            self.pipelines(),
            "a sequence under a grammar or with penalties is not decoded ahead"
        );
        let mut stream = self.prefill_stream(shared)?;
        // When the first token was read: the decode rate on this side of
        // HTTP, to set beside the client's figures.
        let mut first_read = None;
        loop {
            let paused = pause();
            let queue_next = paused.is_none() && self.tokens_left() > 1;
            let token = stream.next_token_by(queue_next, |logits| {
                let pick = self.next_pick();
                self.queue_token(logits, pick)
            })?;
            let since = *first_read.get_or_insert_with(Instant::now);
            let end = self.accept_plain(token, false)?;
            if end.is_some() || paused.is_some() {
                self.publish_answer(shared, stream.cache());
            }
            if let Some(reason) = end {
                let read = self.out.generated();
                if read > 1 {
                    let tok_s = (read - 1) as f64 / since.elapsed().as_secs_f64();
                    tracing::debug!(tokens = read, tok_s, "decode");
                }
                return Ok(Decoded::Finished(reason));
            }
            if let Some(with) = paused {
                return Ok(Decoded::Paused {
                    with,
                    cache: stream.into_cache()?,
                    last_token: token,
                });
            }
        }
    }

    /// Decoding one step at a time, for a sequence whose next pick follows
    /// its current token (a grammar's mask, the penalties' counts): each
    /// token is read before the next step is built. The device lock is
    /// taken per step, so other engines' work interleaves meanwhile. After
    /// each token that does not end it, `pause` is asked, as in
    /// [`Sequence::decode_until`], where the sequence can move
    /// ([`Sequence::can_hand_over`]: not a constrained one, whose grammar's
    /// state stays here).
    pub fn decode_stepwise_until<T>(
        &mut self,
        shared: &SharedModel,
        mut pause: impl FnMut() -> Option<T>,
    ) -> anyhow::Result<Decoded<T>> {
        let model = &shared.model.model;
        let vocab = shared.model.vocab_size();
        let (mut cache, mut logits) = {
            let _device = shared.lock_device();
            self.prefill_logits(shared)?
        };
        loop {
            let allowed = match self.constraint.as_mut() {
                Some(c) => match c.allowed() {
                    Some(set) => Some(sampling::allowed_mask(&set.to_bools(vocab))),
                    None => return Ok(Decoded::Finished(FinishReason::Stop)),
                },
                None => None,
            };
            let _device = shared.lock_device();
            let token = match &allowed {
                Some(allowed) => self.sampler.sample_within(&logits, allowed)?,
                None => self.sampler.sample(&logits)?,
            }
            .item_exact::<u32>();
            if let Some(reason) = self.accept_plain(token, false)? {
                self.publish_answer(shared, &cache);
                return Ok(Decoded::Finished(reason));
            }
            if let Some(with) = pause().filter(|_| self.can_hand_over()) {
                self.publish_answer(shared, &cache);
                eval(&cache.state())?;
                return Ok(Decoded::Paused {
                    with,
                    cache,
                    last_token: token,
                });
            }
            logits = model.forward(&generate::tokens_array(&[token]), &mut cache, Logits::Last)?;
        }
    }

    /// Its prompt prefilled after the prefix cache's longest hit (and kept
    /// there): the cache and the prompt's last logits, for its sampler or
    /// grammar to choose the first token from. Under the device lock.
    pub fn prefill_logits(&mut self, shared: &SharedModel) -> anyhow::Result<(KvCache, Array)> {
        let model = &shared.model.model;
        let (mut cache, done) = self.cached_prefix(shared);
        let logits = self.prefill(shared, &mut cache, done, |cache, tokens, last| {
            generate::prefill_chunk(model, cache, tokens, shared.prefill_chunk(), last)
        })?;
        Ok((cache, logits))
    }

    /// Keeps its prompt and the answer delivered so far (as far as `cache`
    /// holds them) in the prefix cache: the chat's next turn, sent the
    /// moment this one ends, starts from it. Under the device lock.
    pub fn publish_answer(&self, shared: &SharedModel, cache: &KvCache) {
        let tokens = [self.request().prompt.as_slice(), self.out.delivered()].concat();
        self.publish(shared, &tokens, cache);
    }

    /// Keeps `tokens` of it (whose KV `cache` holds from position 0) in
    /// `shared`'s prefix cache, in its request's scope, for requests that
    /// share them (n > 1, the chat's next turn). Under the device lock.
    pub fn publish(&self, shared: &SharedModel, tokens: &[u32], cache: &KvCache) {
        let scope = self.request().cache_scope.as_deref();
        shared.prefix.insert(scope, tokens, cache);
    }

    /// Ends it: its KV blocks and what it holds go back first (the next
    /// request, sent the moment the final event arrives, finds them free),
    /// then the final event.
    pub fn finish(&mut self, reason: FinishReason, spec: Option<SpecStats>) {
        self.release();
        self.out.finish(reason, spec);
    }

    /// Ends it with an error, after giving back what it holds.
    pub fn fail(&mut self, error: StreamError) {
        self.release();
        self.out.fail(error);
    }

    fn release(&mut self) {
        self.reservation.take();
        self.held.clear();
    }

    /// Whether another engine can continue it: not under a grammar, whose
    /// state stays with the engine that compiled it.
    pub fn can_hand_over(&self) -> bool {
        self.constraint.is_none()
    }

    /// Gives it to `sink` with its KV (`cache`: every position before
    /// `last_token`, its newest token) and its blocks; what else it holds
    /// goes back here. Returns whether the sink took it (one it could not
    /// ended with an error).
    pub fn hand_over(mut self, cache: KvCache, last_token: u32, sink: &dyn HandoverSink) -> bool {
        self.held.clear();
        let Some(reservation) = self.reservation.take() else {
            self.out.fail(StreamError::Internal(
                "generation could not continue".into(),
            ));
            return false;
        };
        Handover::of(self.out, cache, last_token, reservation).give_to(sink)
    }
}

/// How [`Sequence::decode_until`] ended.
pub enum Decoded<T> {
    /// The sequence ended for `reason`: [`Sequence::finish`] it.
    Finished(FinishReason),
    /// Stopped where its `pause` answered `with`: `cache` (evaluated, for
    /// another thread) holds every position before `last_token`, its
    /// newest token, streamed and not yet fed.
    Paused {
        with: T,
        cache: KvCache,
        last_token: u32,
    },
}

/// Where one sequence's prefill stands: its KV holds `done` of the
/// `target` tokens it catches up (its prompt; after preemption its whole
/// context). Every engine's chunks follow its rule
/// ([`Prefill::chunk_end`]); [`Sequence::prefill`] runs them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefill {
    pub done: usize,
    pub target: usize,
    /// Where a hybrid model's prefix is kept: a snapshot of the prompt's
    /// last block boundary (`SharedPrefixCache::snapshot_at`).
    snapshot: Option<usize>,
}

impl Prefill {
    pub fn new(done: usize, target: usize, snapshot: Option<usize>) -> Self {
        Self {
            done,
            target,
            snapshot,
        }
    }

    pub fn is_done(&self) -> bool {
        self.done >= self.target
    }

    /// Tokens still to compute.
    pub fn left(&self) -> usize {
        self.target.saturating_sub(self.done)
    }

    /// Where the next chunk of at most `tokens` stops: at the snapshot
    /// point when it falls inside (the prefix is kept there), and never
    /// inside an image of `request`'s whose tokens attend both ways.
    pub fn chunk_end(&self, request: &GenerateRequest, tokens: usize) -> usize {
        let end = (self.done + tokens).min(self.target);
        let end = match self.snapshot {
            Some(at) if self.done < at && at < end => at,
            _ => end,
        };
        crate::vision::chunk_end(&request.images, self.done, end)
    }

    /// The KV now holds the tokens up to `end`; returns whether that is
    /// the snapshot point, to be kept in the prefix cache.
    pub fn advance(&mut self, end: usize) -> bool {
        self.done = end;
        self.snapshot == Some(end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine_core::event::event_channel;
    use engine_core::{Event, EventStream, SamplingParams};

    use crate::kv_pool::KvPool;

    fn started(max_tokens: u32) -> (Sequence, EventStream, KvPool) {
        let pool = KvPool::new(4, 16, 1);
        let mut req = GenerateRequest::new(vec![1, 2, 3], max_tokens);
        req.stop_tokens = vec![9];
        req.sampling = SamplingParams::greedy();
        let (tx, rx) = event_channel();
        let r = pool.try_reserve(2).unwrap();
        let seq = Sequence::start(req, tx, r, 16, |_| Err("no grammars".into())).unwrap();
        (seq, rx, pool)
    }

    #[test]
    fn blocks_and_holdings_go_back_before_the_final_event() {
        let (mut seq, mut rx, pool) = started(4);
        let slot = std::sync::Arc::new(());
        seq.hold(slot.clone());
        assert_eq!((pool.allocated(), seq.blocks()), (2, 2));
        assert_eq!(seq.accept_plain(4, false).unwrap(), None);
        assert_eq!(
            seq.accept_plain(9, false).unwrap(),
            Some(FinishReason::Stop)
        );
        seq.finish(FinishReason::Stop, None);
        assert_eq!(pool.allocated(), 0);
        assert_eq!(std::sync::Arc::strong_count(&slot), 1);
        let events: Vec<Event> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        assert_eq!(events.len(), 2, "{events:?}");
        assert!(matches!(&events[1], Event::Finished(f) if f.completion_tokens == 1));
    }

    #[test]
    fn a_grammar_that_is_over_ends_without_the_token() {
        let (mut seq, mut rx, _pool) = started(4);
        assert_eq!(seq.accept_plain(4, true).unwrap(), Some(FinishReason::Stop));
        assert!(rx.try_recv().is_err(), "nothing streamed");
        assert_eq!(seq.out.generated(), 0);
    }

    #[test]
    fn an_invalid_grammar_ends_the_stream_with_the_clients_error() {
        let pool = KvPool::new(4, 16, 1);
        let mut req = GenerateRequest::new(vec![1, 2, 3], 4);
        req.grammar = Some(engine_core::Grammar::Regex("(".into()));
        let (tx, mut rx) = event_channel();
        let r = pool.try_reserve(1).unwrap();
        assert!(Sequence::start(req, tx, r, 16, |_| Err("bad regex".into())).is_none());
        assert_eq!(pool.allocated(), 0);
        match rx.try_recv() {
            Ok(Event::Error(StreamError::Invalid(m))) => assert!(m.ends_with("bad regex"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    fn handover(pool: &KvPool, grammar: Option<engine_core::Grammar>) -> (Handover, EventStream) {
        let mut request = GenerateRequest::new(vec![1, 2, 3], 4);
        request.grammar = grammar;
        let (events, rx) = event_channel();
        let h = Handover {
            request,
            cache: KvCache::new(0, 1),
            last_token: 5,
            generated: vec![4, 5],
            cached_tokens: 0,
            reservation: pool.try_reserve(1).unwrap(),
            events,
        };
        (h, rx)
    }

    #[test]
    fn a_handed_over_sequence_goes_on_from_its_newest_token() {
        let pool = KvPool::new(4, 16, 1);
        let (h, _rx) = handover(&pool, None);
        let (seq, _cache, last) = Sequence::resume(h, 16).unwrap();
        assert!(seq.can_hand_over());
        assert_eq!(
            (last, seq.context(), seq.blocks()),
            (5, vec![1, 2, 3, 4], 1)
        );
        assert_eq!(seq.tokens_left(), 2);
    }

    #[test]
    fn a_constrained_sequence_does_not_continue_elsewhere() {
        let pool = KvPool::new(4, 16, 1);
        let (h, mut rx) = handover(&pool, Some(engine_core::Grammar::Regex("a+".into())));
        assert!(Sequence::resume(h, 16).is_none());
        assert_eq!(pool.allocated(), 0, "its blocks went back");
        assert!(matches!(
            rx.try_recv(),
            Ok(Event::Error(StreamError::Internal(_)))
        ));
    }

    #[test]
    fn chunks_stop_at_the_snapshot_and_never_inside_an_image() {
        let mut request = GenerateRequest::new(vec![1; 100], 4);
        let mut at = Prefill::new(0, 100, Some(64));
        assert_eq!(at.chunk_end(&request, 48), 48);
        assert!(!at.advance(48));
        assert_eq!((at.chunk_end(&request, 48), at.left()), (64, 52));
        assert!(at.advance(64), "the snapshot point: kept");
        assert_eq!(at.chunk_end(&request, 48), 100);
        assert!(!at.advance(100));
        assert!(at.is_done());
        // A prefix hit at the snapshot goes on past it.
        let from_hit = Prefill::new(64, 100, Some(64));
        assert_eq!(from_hit.chunk_end(&request, 16), 80);
        // An image whose tokens attend both ways is one chunk's.
        request.images = vec![engine_core::ImageInput {
            start: 40,
            tokens: 20,
            width: 1,
            embeddings: std::sync::Arc::new(vec![0.0; 20]),
            bidirectional: true,
        }];
        let at = Prefill::new(0, 100, None);
        assert_eq!(at.chunk_end(&request, 48), 60);
    }

    #[test]
    fn the_context_is_every_position_fed() {
        let (mut seq, _rx, _pool) = started(4);
        seq.accept_plain(4, false).unwrap();
        seq.accept_plain(5, false).unwrap();
        assert_eq!(seq.context(), vec![1, 2, 3, 4]);
        assert_eq!(seq.context_len(), 4);
        assert_eq!(seq.tokens_left(), 2);
    }
}
