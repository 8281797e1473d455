//! What the scheduler asks of the model and its device, as a trait, so the
//! whole loop also runs on a fake forward (the scheduler's tests): KV of a
//! sequence or of the batch, the prefix cache, the forwards (a padded
//! group, a prefill chunk, a decode step, or a decode step and chunks in
//! one mixed forward) and their picks. [`Mlx`] is the
//! real one: the model's forwards on MLX arrays, rows sampling with their
//! own parameters.

use std::sync::Arc;

use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{ops, Array, Dtype};
use runtime::model::{Logits, Segment};
use runtime::sampling;
use runtime::shared::DeviceTurn;
use runtime::{generate, memory, vision, KvCache, KvPool, SharedModel};

use crate::row::Row;

/// A kept prefix of a sequence: its KV and how many tokens it holds.
pub type Prefix<Kv> = (Kv, usize);

/// One row's pick of a step, read on the host.
pub struct Pick {
    pub token: u32,
    /// The row's grammar is complete or allows nothing more: it ends
    /// without this token.
    pub grammar_over: bool,
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The picks of a step built and not yet read (pipelined decode keeps one
/// queued on the device).
pub trait Picks: Sized {
    /// The rows it was built for: the batch's first `rows()`.
    fn rows(&self) -> usize;

    /// The picks of the rows at `keep` (ascending indices of the batch
    /// before rows left), or `None` when none of its rows is kept.
    fn keep(self, keep: &[usize]) -> anyhow::Result<Option<Self>>;
}

/// A prompt chunk of a mixed forward: `tokens` (positions `start..`) of
/// `row` into `kv`, with its pick when `pick`.
pub struct Chunk<'a, Kv> {
    pub row: &'a mut Row,
    pub kv: &'a mut Kv,
    pub tokens: &'a [u32],
    pub start: usize,
    pub pick: bool,
}

/// What a mixed forward picks: for the batch's rows, and per chunk (in
/// order; `None` for one without a pick).
pub struct MixedPicks<P> {
    pub decode: Option<P>,
    pub chunks: Vec<Option<P>>,
}

pub trait Device: Clone {
    /// KV of one sequence, or of the batch (one row per sequence).
    type Kv;
    type Picks: Picks;
    /// Held while the step uses the device.
    type Turn<'a>
    where
        Self: 'a;

    fn turn(&self) -> Self::Turn<'_>;
    fn pool(&self) -> &KvPool;
    fn vocab(&self) -> i32;
    fn grammar(&self, grammar: &engine_core::Grammar) -> Result<grammar::Constraint, String>;
    /// Gives cached device memory back after running out of it.
    fn release_memory(&self);

    /// KV of an empty sequence.
    fn new_kv(&self) -> Self::Kv;
    /// Columns of the batch's KV (for the step log).
    fn columns(&self, kv: &Self::Kv) -> usize;
    /// A handed-over sequence's cache in this device's form.
    fn adopted(&self, cache: KvCache) -> anyhow::Result<Self::Kv>;
    /// `part`'s rows appended to `batch`'s.
    fn join(&self, batch: Option<Self::Kv>, part: Self::Kv) -> anyhow::Result<Self::Kv>;
    /// Keeps the rows at `keep` (ascending).
    fn select_rows(&self, kv: &mut Self::Kv, keep: &[usize]) -> anyhow::Result<()>;

    /// The prefix cache: the KV and length of the longest kept prefix of
    /// `tokens` in `scope`.
    fn lookup(&self, scope: Option<&str>, tokens: &[u32]) -> Option<Prefix<Self::Kv>>;
    fn has_hit(&self, scope: Option<&str>, tokens: &[u32]) -> bool;
    /// Whether a sequence of `tokens` would be kept.
    fn wants(&self, tokens: usize) -> bool;
    /// Where a prefill of a prompt of `prompt_len` tokens ends a chunk so
    /// its KV can be kept (a hybrid model's recurrent state).
    fn snapshot_at(&self, prompt_len: usize) -> Option<usize>;
    /// Keeps `tokens`, whose KV is row `row` of `kv` (or all of it).
    fn keep(&self, scope: Option<&str>, tokens: &[u32], kv: &Self::Kv, row: Option<usize>);

    /// The prompts of `rows`, left-padded to `width`, in one forward; their
    /// first picks.
    fn prefill_group(
        &self,
        rows: &mut [Row],
        width: usize,
    ) -> anyhow::Result<(Self::Kv, Self::Picks)>;
    /// `tokens` (positions `start..`) of `row` into `kv`: with its pick
    /// when `pick`, else evaluated.
    fn prefill(
        &self,
        row: &mut Row,
        kv: &mut Self::Kv,
        tokens: &[u32],
        start: usize,
        pick: bool,
    ) -> anyhow::Result<Option<Self::Picks>>;
    /// One decode step of the batch, built and not read. Its inputs:
    /// `prev`'s picks, on the device, for the rows it covers; each other
    /// row's newest token.
    fn decode(
        &self,
        batch: &mut Self::Kv,
        rows: &mut [Row],
        prev: Option<&Self::Picks>,
    ) -> anyhow::Result<Self::Picks>;
    /// Whether `row`'s prompt chunks may run in a mixed forward
    /// ([`Device::mixed`]).
    fn mixes(&self, row: &Row) -> bool;
    /// One forward of the batch's decode step (as [`Device::decode`]; none
    /// without a batch) and `chunks` of sequences catching up (as
    /// [`Device::prefill`] each): its picks, built and not read, for the
    /// batch and for each chunk that asked.
    fn mixed(
        &self,
        batch: Option<&mut Self::Kv>,
        rows: &mut [Row],
        prev: Option<&Self::Picks>,
        chunks: &mut [Chunk<'_, Self::Kv>],
    ) -> anyhow::Result<MixedPicks<Self::Picks>>;
    /// Queues `picks` on the device without waiting.
    fn launch(&self, picks: &Self::Picks) -> anyhow::Result<()>;
    /// Waits for `picks` and reads them, one per row of `rows`.
    fn read(&self, rows: &[Row], picks: Self::Picks) -> anyhow::Result<Vec<Pick>>;
}

/// The model's forwards on MLX.
#[derive(Clone)]
pub struct Mlx(pub Arc<SharedModel>);

impl Device for Mlx {
    type Kv = KvCache;
    type Picks = Step;
    type Turn<'a> = DeviceTurn<'a>;

    fn turn(&self) -> DeviceTurn<'_> {
        self.0.lock_device()
    }

    fn pool(&self) -> &KvPool {
        &self.0.kv_pool
    }

    fn vocab(&self) -> i32 {
        self.0.model.vocab_size() as i32
    }

    fn grammar(&self, grammar: &engine_core::Grammar) -> Result<grammar::Constraint, String> {
        self.0
            .grammars()
            .and_then(|c| c.compile(grammar).map_err(|e| e.0))
    }

    fn release_memory(&self) {
        memory::release_cache();
    }

    fn new_kv(&self) -> KvCache {
        self.0.new_cache(vec![0])
    }

    fn columns(&self, kv: &KvCache) -> usize {
        kv.len() as usize
    }

    /// A cache that arrives contiguous (a sequence a contiguous-cache
    /// build handed over) moves into the server's paged pool.
    fn adopted(&self, cache: KvCache) -> anyhow::Result<KvCache> {
        match self.0.pages() {
            Some(pool) => cache.into_paged(pool),
            None => Ok(cache),
        }
    }

    fn join(&self, batch: Option<KvCache>, part: KvCache) -> anyhow::Result<KvCache> {
        KvCache::join(batch, self.adopted(part)?)
    }

    fn select_rows(&self, kv: &mut KvCache, keep: &[usize]) -> anyhow::Result<()> {
        kv.select_rows(keep)
    }

    fn lookup(&self, scope: Option<&str>, tokens: &[u32]) -> Option<Prefix<KvCache>> {
        let layers = self.0.model.model.num_layers();
        let hit = self.0.prefix.lookup(scope, tokens, layers)?;
        Some((hit.cache, hit.tokens))
    }

    fn has_hit(&self, scope: Option<&str>, tokens: &[u32]) -> bool {
        self.0.prefix.has_hit(scope, tokens)
    }

    fn wants(&self, tokens: usize) -> bool {
        self.0.prefix.wants(tokens)
    }

    fn snapshot_at(&self, prompt_len: usize) -> Option<usize> {
        self.0.prefix.snapshot_at(prompt_len)
    }

    fn keep(&self, scope: Option<&str>, tokens: &[u32], kv: &KvCache, row: Option<usize>) {
        let row = match row.map(|i| kv.extract_row(i)).transpose() {
            Ok(row) => row,
            Err(e) => return tracing::warn!(error = %e, "keeping a row's prefix failed"),
        };
        self.0
            .prefix
            .insert(scope, tokens, row.as_ref().unwrap_or(kv));
    }

    fn prefill_group(&self, rows: &mut [Row], width: usize) -> anyhow::Result<(KvCache, Step)> {
        let prompts = rows.iter().map(|r| r.request().prompt.as_slice());
        let (ids, pads) = generate::left_padded(prompts, width);
        let mut cache = self.0.new_cache(pads);
        let logits = self.0.model.model.forward(&ids, &mut cache, Logits::Last)?;
        let picks = sample_step(rows, &logits)?;
        eval(picks.arrays())?;
        Ok((cache, picks))
    }

    fn prefill(
        &self,
        row: &mut Row,
        kv: &mut KvCache,
        tokens: &[u32],
        start: usize,
        pick: bool,
    ) -> anyhow::Result<Option<Step>> {
        let model = &self.0.model.model;
        let ids = generate::tokens_array(tokens);
        let logits = match vision::replacement(&row.request().images, start, tokens.len()) {
            Some(images) => model.forward_replacing(&ids, &images, kv, Logits::Last)?,
            None => model.forward(&ids, kv, Logits::Last)?,
        };
        if !pick {
            eval(&kv.state())?;
            return Ok(None);
        }
        let picks = sample_step(std::slice::from_mut(row), &logits)?;
        eval(picks.arrays())?;
        Ok(Some(picks))
    }

    fn decode(
        &self,
        batch: &mut KvCache,
        rows: &mut [Row],
        prev: Option<&Step>,
    ) -> anyhow::Result<Step> {
        let b = rows.len();
        let inputs = decode_inputs(rows, prev)?;
        let logits =
            self.0
                .model
                .model
                .forward(&inputs.reshape(&[b as i32, 1])?, batch, Logits::Last)?;
        sample_step(rows, &logits)
    }

    /// Attention-only models on the CPU, prompts without images (their
    /// embeddings are replaced per forward). The GPU keeps separate
    /// forwards: mixed, an H200 served staggered long prompts at 0.63x
    /// the throughput and 1.6x the TTFT p99 (docs/batching.md).
    fn mixes(&self, row: &Row) -> bool {
        self.0.model.model.mixes() && row.request().images.is_empty() && !runtime::mask::on_gpu()
    }

    fn mixed(
        &self,
        batch: Option<&mut KvCache>,
        rows: &mut [Row],
        prev: Option<&Step>,
        chunks: &mut [Chunk<'_, KvCache>],
    ) -> anyhow::Result<MixedPicks<Step>> {
        let decoding = batch.is_some();
        let mut segments = Vec::with_capacity(chunks.len() + 1);
        if let Some(batch) = batch {
            let inputs = decode_inputs(rows, prev)?;
            segments.push(Segment {
                tokens: inputs.reshape(&[rows.len() as i32, 1])?,
                cache: batch,
                logits: true,
            });
        }
        for c in chunks.iter_mut() {
            debug_assert_eq!(c.kv.row_len(0) as usize, c.start, "a chunk follows its KV");
            segments.push(Segment {
                tokens: generate::tokens_array(c.tokens),
                cache: &mut *c.kv,
                logits: c.pick,
            });
        }
        let mut logits = self.0.model.model.forward_mixed(&mut segments)?.into_iter();
        drop(segments);
        let decode = match decoding {
            true => Some(sample_step(
                rows,
                &logits.next().flatten().expect("the batch's logits"),
            )?),
            false => None,
        };
        let picks = chunks
            .iter_mut()
            .zip(logits)
            .map(|(c, l)| {
                l.map(|l| sample_step(std::slice::from_mut(c.row), &l))
                    .transpose()
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        // Without a pick to read, the chunks' KV is evaluated here (a pick
        // depends on every row of the stream, so it evaluates them all).
        if decode.is_none() && picks.iter().all(Option::is_none) {
            eval(
                chunks
                    .iter()
                    .flat_map(|c| c.kv.state())
                    .collect::<Vec<_>>()
                    .iter(),
            )?;
        }
        Ok(MixedPicks {
            decode,
            chunks: picks,
        })
    }

    fn launch(&self, picks: &Step) -> anyhow::Result<()> {
        Ok(async_eval(picks.arrays())?)
    }

    fn read(&self, rows: &[Row], step: Step) -> anyhow::Result<Vec<Pick>> {
        eval(step.arrays())?;
        let tokens = step.tokens.as_slice::<u32>();
        let picks = rows[..step.rows]
            .iter()
            .enumerate()
            .map(|(i, row)| {
                let token = tokens[i];
                let top = row.request().sampling.top_logprobs as usize;
                let (logprob, top_logprobs) = match step.logprobs.iter().find(|(j, _)| *j == i) {
                    Some((_, lp)) => sampling::token_logprobs(lp.as_slice::<f32>(), token, top),
                    None => (None, Vec::new()),
                };
                Pick {
                    token,
                    grammar_over: matches!(step.masks[i], Mask::Over),
                    logprob,
                    top_logprobs,
                }
            })
            .collect();
        Ok(picks)
    }
}

/// A decode step's `[B]` inputs: `prev`'s picks, on the device, for the
/// rows it covers; each other row's newest token.
fn decode_inputs(rows: &[Row], prev: Option<&Step>) -> anyhow::Result<Array> {
    let on_device = prev.map_or(0, |s| s.rows);
    let host: Vec<i32> = rows[on_device..]
        .iter()
        .map(|r| r.last_token as i32)
        .collect();
    let host = Array::from_slice(&host, &[host.len() as i32]);
    Ok(match prev {
        None => host,
        Some(s) if on_device == rows.len() => s.tokens.as_dtype(Dtype::Int32)?,
        Some(s) => ops::concatenate(&[s.tokens.as_dtype(Dtype::Int32)?, host], 0)?,
    })
}

/// The picks of one step of the batch's first `rows` rows, built and not
/// read: on the device until [`Mlx::read`] reads them.
pub struct Step {
    /// `[rows]` uint32.
    tokens: Array,
    /// Log-probability vectors of the rows that asked.
    logprobs: Vec<(usize, Array)>,
    masks: Vec<Mask>,
    rows: usize,
}

impl Step {
    /// What evaluates it.
    fn arrays(&self) -> impl Iterator<Item = &Array> {
        std::iter::once(&self.tokens).chain(self.logprobs.iter().map(|(_, a)| a))
    }
}

impl Picks for Step {
    fn rows(&self) -> usize {
        self.rows
    }

    fn keep(self, keep: &[usize]) -> anyhow::Result<Option<Step>> {
        let kept: Vec<usize> = keep.iter().copied().filter(|&i| i < self.rows).collect();
        if kept.is_empty() {
            return Ok(None);
        }
        if kept.len() == self.rows {
            return Ok(Some(self));
        }
        let idx: Vec<i32> = kept.iter().map(|&i| i as i32).collect();
        let tokens = self
            .tokens
            .take_axis(Array::from_slice(&idx, &[idx.len() as i32]), 0)?;
        let logprobs = self
            .logprobs
            .into_iter()
            .filter_map(|(i, a)| kept.iter().position(|&k| k == i).map(|j| (j, a)))
            .collect();
        let mut masks: Vec<Option<Mask>> = self.masks.into_iter().map(Some).collect();
        let masks = kept.iter().map(|&i| masks[i].take().unwrap()).collect();
        Ok(Some(Step {
            tokens,
            logprobs,
            masks,
            rows: kept.len(),
        }))
    }
}

/// Builds the picks of every row from `[B, 1, V]` logits (with grammar
/// masks from the rows' current states), without reading them.
fn sample_step(rows: &mut [Row], logits: &Array) -> anyhow::Result<Step> {
    let logits = logits.reshape(&[rows.len() as i32, -1])?;
    let masks = grammar_masks(rows, logits.dim(-1) as usize);
    let (tokens, logprobs) = sample_rows(rows, &logits, &masks)?;
    Ok(Step {
        tokens,
        logprobs,
        masks,
        rows: rows.len(),
    })
}

/// A row's grammar at this step.
enum Mask {
    Free,
    Allowed(Array),
    /// Complete, or a dead end: the row ends without another token.
    Over,
}

impl Mask {
    /// The set its pick is drawn within (an ended row's pick is never read).
    fn allowed(&self) -> Option<&Array> {
        match self {
            Mask::Allowed(allowed) => Some(allowed),
            Mask::Free | Mask::Over => None,
        }
    }
}

fn grammar_masks(rows: &mut [Row], vocab: usize) -> Vec<Mask> {
    rows.iter_mut()
        .map(|row| match row.seq.constraint.as_mut() {
            None => Mask::Free,
            Some(c) => match c.allowed() {
                Some(allowed) => Mask::Allowed(sampling::allowed_mask(&allowed.to_bools(vocab))),
                None => Mask::Over,
            },
        })
        .collect()
}

/// Next token of every row from `[B, V]` logits, lazily: one draw for the
/// whole batch ([`sampling::draw`]), from the logits as they are except
/// for the rows whose sampler adjusts them or whose grammar masks them.
/// Returns the `[B]` uint32 tokens and, for rows that asked, their
/// log-probability vectors.
fn sample_rows(
    rows: &mut [Row],
    logits: &Array,
    masks: &[Mask],
) -> anyhow::Result<(Array, Vec<(usize, Array)>)> {
    let own = |row: &Row, mask: &Mask| row.seq.sampler.adjusts() || mask.allowed().is_some();
    let drawn_from = match rows.iter().zip(masks).any(|(r, m)| own(r, m)) {
        false => logits.clone(),
        true => {
            let mut each = Vec::with_capacity(rows.len());
            for (i, (row, mask)) in rows.iter().zip(masks).enumerate() {
                let l = logits.take_axis(Array::from_slice(&[i as i32], &[1]), 0)?;
                each.push(match own(row, mask) {
                    false => l,
                    true => row.seq.sampler.drawn_from(&l, mask.allowed())?,
                });
            }
            ops::concatenate(&each, 0)?
        }
    };
    let picks: Vec<sampling::Pick> = rows.iter_mut().map(|r| r.seq.sampler.next_pick()).collect();
    let tokens = sampling::draw(&drawn_from, &picks)?.as_dtype(Dtype::Uint32)?;
    let mut lps = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        if row.seq.wants_logprobs() {
            let l = logits.take_axis(Array::from_slice(&[i as i32], &[1]), 0)?;
            lps.push((i, row.seq.sampler.logprobs(&l)?));
        }
    }
    Ok((tokens, lps))
}
