//! The raw model loop: chunked prefill, then decode one token at a time with
//! the next step's graph built while the current one computes (the same
//! pipelining mlx-lm's `generate_step` does). The fast path engine runs this
//! loop; the oracle test and the benchmark measure it.

use std::time::{Duration, Instant};

use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{ops, Array};

use crate::cache::KvCache;
use crate::model::{Logits, Model};
use crate::paged::PagePool;
use crate::sampling::{Pick, Sampler};

/// Prompt tokens per prefill forward (bounds the activation memory).
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

pub fn tokens_array(tokens: &[u32]) -> Array {
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    Array::from_slice(&ids, &[1, ids.len() as i32])
}

/// On a GPU, prefill widths are padded to a multiple of this many tokens:
/// MLX builds kernels and attention graphs once per forward shape (50-100
/// ms each on an H200 for a 4B model, then about 10 ms a prefill), so
/// prompts of random lengths would pay it on nearly every request. The
/// batched engine pads its prefill groups to the same multiple.
const GPU_SHAPE_MULTIPLE: usize = 32;

/// The multiple prefill widths are padded to, computing on a GPU or not:
/// none on the CPU, which pays for padding per token.
pub fn shape_multiple(gpu: bool) -> usize {
    if gpu {
        GPU_SHAPE_MULTIPLE
    } else {
        1
    }
}

/// Runs the prompt through the model in chunks and returns the `[1, 1, V]`
/// logits of its last position; the last chunk is padded as
/// [`prefill_padded`] does, to this device's [`shape_multiple`].
pub fn prefill(
    model: &Model,
    cache: &mut KvCache,
    prompt: &[u32],
    chunk: usize,
) -> anyhow::Result<Array> {
    let multiple = shape_multiple(!crate::compute::on_cpu());
    prefill_padded(model, cache, prompt, chunk, multiple)
}

/// [`prefill`] with the last chunk padded at its end to a multiple of
/// `multiple` tokens (while it stays within `chunk`): causal attention
/// keeps the padding out of the real positions, the logits are read at the
/// last real one, and the padding's keys and values are dropped after. A
/// model with recurrent layers is not padded: its state would run through
/// the padding.
pub fn prefill_padded(
    model: &Model,
    cache: &mut KvCache,
    prompt: &[u32],
    chunk: usize,
    multiple: usize,
) -> anyhow::Result<Array> {
    anyhow::ensure!(!prompt.is_empty(), "empty prompt");
    let chunk = chunk.max(1);
    let mut rest = prompt;
    while rest.len() > chunk {
        let (head, tail) = rest.split_at(chunk);
        model.forward(&tokens_array(head), cache, Logits::Last)?;
        // Materialise the cache so the next chunk's graph stays small.
        eval(&cache.state())?;
        rest = tail;
    }
    forward_padded(model, cache, rest, chunk, multiple)
}

/// One chunk of a prompt (at most `chunk` `tokens`) as [`prefill`] runs
/// it: the `last` one padded to this device's [`shape_multiple`].
pub fn prefill_chunk(
    model: &Model,
    cache: &mut KvCache,
    tokens: &[u32],
    chunk: usize,
    last: bool,
) -> anyhow::Result<Array> {
    if !last {
        return model.forward(&tokens_array(tokens), cache, Logits::Last);
    }
    let multiple = shape_multiple(!crate::compute::on_cpu());
    forward_padded(model, cache, tokens, chunk, multiple)
}

/// A prompt's last prefill forward, of at most `chunk` `tokens`, padded
/// as [`prefill_padded`] says; the `[1, 1, V]` logits of its last token.
pub fn forward_padded(
    model: &Model,
    cache: &mut KvCache,
    tokens: &[u32],
    chunk: usize,
    multiple: usize,
) -> anyhow::Result<Array> {
    let width = padded_width(tokens.len(), chunk, multiple, model.is_hybrid());
    if width == tokens.len() {
        return model.forward(&tokens_array(tokens), cache, Logits::Last);
    }
    let mut padded = tokens.to_vec();
    padded.resize(width, 0);
    let last = Logits::At(tokens.len() as i32 - 1);
    let logits = model.forward(&tokens_array(&padded), cache, last)?;
    cache.truncate((width - tokens.len()) as i32)?;
    Ok(logits)
}

/// The width a last prefill chunk of `len` tokens runs at: `len` rounded
/// up to `multiple`, unless that passes `chunk` or the model has recurrent
/// layers (`hybrid`).
pub fn padded_width(len: usize, chunk: usize, multiple: usize, hybrid: bool) -> usize {
    let width = len.next_multiple_of(multiple.max(1));
    if hybrid || width > chunk {
        len
    } else {
        width
    }
}

/// Decode steps [`warm_up`] runs: past the lengths a short exchange
/// reaches.
const WARM_DECODE_STEPS: usize = 256;

/// Builds before the first request what MLX CUDA builds on the first use
/// of a forward shape (kernels and attention graphs: 50-600 ms each for a
/// 4B model on an H200, docs/benchmarks.md, "First-shape costs and
/// prefill"): a prefill at every padded
/// width up to `chunk`, then a greedy decode of [`WARM_DECODE_STEPS`]
/// tokens, on caches from `new_cache` (the server's layout). The kernels
/// are the process's, so every engine gains. Nothing on the CPU, which
/// builds nothing per shape. Returns the time it took.
pub fn warm_up(
    model: &Model,
    chunk: usize,
    new_cache: impl Fn() -> KvCache,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let multiple = shape_multiple(!crate::compute::on_cpu());
    if multiple == 1 {
        return Ok(Duration::ZERO);
    }
    for width in (multiple..=chunk).step_by(multiple) {
        let mut cache = new_cache();
        eval([&prefill(model, &mut cache, &vec![0; width], chunk)?])?;
    }
    let mut stream = DecodeStream::resume(model, new_cache(), &vec![0; multiple], chunk)?;
    for _ in 0..WARM_DECODE_STEPS {
        stream.next_token(true)?;
    }
    Ok(started.elapsed())
}

/// Makes every layer's buffers of `pool` now by running one token through
/// `model` (so the pool's memory is taken at startup, not mid-serving).
pub fn preallocate(model: &Model, pool: &PagePool) -> anyhow::Result<()> {
    let mut cache = model.new_paged_cache(pool, vec![0]);
    let logits = model.forward(&tokens_array(&[0]), &mut cache, Logits::Last)?;
    eval([&logits])?;
    eval(&cache.state())?;
    Ok(())
}

/// The greedy token of `[1, 1, V]` logits, queued to compute while the
/// host goes on.
pub fn queue_argmax(logits: &Array) -> anyhow::Result<Array> {
    let token = argmax_tokens(logits)?;
    async_eval([&token])?;
    Ok(token)
}

/// The token `sampler` draws as `pick` (its [`Sampler::next_pick`]) from
/// `[1, 1, V]` logits, `[1, 1]` int32, queued to compute while the host
/// goes on.
pub fn queue_pick(sampler: &Sampler, pick: Pick, logits: &Array) -> anyhow::Result<Array> {
    let token = sampler
        .draw_as(logits, None, pick)?
        .reshape(&[1, 1])?
        .as_dtype(mlx_rs::Dtype::Int32)?;
    async_eval([&token])?;
    Ok(token)
}

/// Greedy token from `[B, 1, V]` logits as a lazy `[B, 1]` int32 array.
pub fn argmax_tokens(logits: &Array) -> anyhow::Result<Array> {
    let b = logits.dim(0);
    Ok(ops::indexing::argmax_axis(logits, -1, None)?
        .reshape(&[b, 1])?
        .as_dtype(mlx_rs::Dtype::Int32)?)
}

pub struct GreedyRun {
    pub tokens: Vec<u32>,
    /// Time to the first token (prefill included).
    pub prefill_time: Duration,
    /// Time for the remaining tokens.
    pub decode_time: Duration,
}

/// One sequence decoded with each step's graph queued before the previous
/// token is read, so the device never waits for the host: greedily
/// ([`DecodeStream::next_token`]), or by a pick built from each step's
/// logits ([`DecodeStream::next_token_by`], a sampler's draw). The raw loop
/// below and the fast path engine both drive it.
pub struct DecodeStream<'m> {
    model: &'m Model,
    cache: KvCache,
    /// The token computed (or being computed) and not yet read.
    pending: Array,
}

impl<'m> DecodeStream<'m> {
    /// Prefills the prompt and queues its first token.
    pub fn start(model: &'m Model, prompt: &[u32]) -> anyhow::Result<Self> {
        Self::resume(model, model.new_cache(1), prompt, DEFAULT_PREFILL_CHUNK)
    }

    /// Prefills the `rest` of a prompt whose beginning `cache` holds (a
    /// prefix-cache hit) in `chunk`-token forwards and queues its first
    /// token.
    pub fn resume(
        model: &'m Model,
        mut cache: KvCache,
        rest: &[u32],
        chunk: usize,
    ) -> anyhow::Result<Self> {
        let logits = prefill(model, &mut cache, rest, chunk)?;
        Ok(Self::queued(model, cache, queue_argmax(&logits)?))
    }

    /// Goes on from a prefilled `cache` and its first token, `pending`
    /// (`[1, 1]` int32, queued: [`queue_argmax`] or [`queue_pick`] of the
    /// prompt's last logits).
    pub fn queued(model: &'m Model, cache: KvCache, pending: Array) -> Self {
        Self {
            model,
            cache,
            pending,
        }
    }

    /// Reads the pending token. With `queue_next`, the step that follows it
    /// is queued first, its token the argmax; without, the stream ends here
    /// (its cache then holds every position before the returned token).
    pub fn next_token(&mut self, queue_next: bool) -> anyhow::Result<u32> {
        self.next_token_by(queue_next, queue_argmax)
    }

    /// [`DecodeStream::next_token`] with the next step's token queued by
    /// `pick` from its `[1, 1, V]` logits (`[1, 1]` int32, as
    /// [`queue_pick`] gives a sampler's).
    pub fn next_token_by(
        &mut self,
        queue_next: bool,
        pick: impl FnOnce(&Array) -> anyhow::Result<Array>,
    ) -> anyhow::Result<u32> {
        let current = if queue_next {
            let logits = self
                .model
                .forward(&self.pending, &mut self.cache, Logits::Last)?;
            let next = pick(&logits)?;
            std::mem::replace(&mut self.pending, next)
        } else {
            self.pending.clone()
        };
        Ok(current.item_exact::<i32>() as u32)
    }

    /// Every position fed so far: the prompt, then each token read with
    /// `queue_next`.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// The cache, evaluated: arrays still lazy would be computed on this
    /// thread's stream, which the thread that takes the cache over lacks
    /// (a linear layer's convolution state is no input of the logits).
    pub fn into_cache(self) -> anyhow::Result<KvCache> {
        eval(&self.cache.state())?;
        Ok(self.cache)
    }
}

/// Greedy decoding of one sequence: stops at `max_tokens` or a stop token
/// (the stop token is not included). `on_token` may stop early by returning
/// false.
pub fn greedy(
    model: &Model,
    prompt: &[u32],
    max_tokens: usize,
    stop_tokens: &[u32],
    mut on_token: impl FnMut(u32) -> bool,
) -> anyhow::Result<GreedyRun> {
    let start = Instant::now();
    let mut out = Vec::with_capacity(max_tokens);
    if max_tokens == 0 {
        return Ok(GreedyRun {
            tokens: out,
            prefill_time: start.elapsed(),
            decode_time: Duration::ZERO,
        });
    }
    let mut stream = DecodeStream::start(model, prompt)?;
    let mut prefill_time = None;
    loop {
        let more = out.len() + 1 < max_tokens;
        let token = stream.next_token(more)?;
        prefill_time.get_or_insert_with(|| start.elapsed());
        if stop_tokens.contains(&token) {
            break;
        }
        out.push(token);
        if !on_token(token) || !more {
            break;
        }
    }
    let prefill_time = prefill_time.unwrap_or_default();
    Ok(GreedyRun {
        tokens: out,
        prefill_time,
        decode_time: start.elapsed() - prefill_time,
    })
}

/// Prompts of different lengths as one left-padded `[B, width]` batch,
/// with each row's padding; `width` is at least the longest prompt (0: just
/// that).
pub fn left_padded<'a>(
    prompts: impl ExactSizeIterator<Item = &'a [u32]> + Clone,
    width: usize,
) -> (Array, Vec<i32>) {
    let b = prompts.len() as i32;
    let longest = prompts
        .clone()
        .map(<[u32]>::len)
        .max()
        .unwrap_or(0)
        .max(width);
    let mut ids = Vec::with_capacity(prompts.len() * longest);
    let mut pads = Vec::with_capacity(prompts.len());
    for p in prompts {
        pads.push((longest - p.len()) as i32);
        ids.extend(std::iter::repeat_n(0i32, longest - p.len()));
        ids.extend(p.iter().map(|&t| t as i32));
    }
    (Array::from_slice(&ids, &[b, longest as i32]), pads)
}

/// Greedy decoding of several prompts of different lengths as one
/// left-padded batch: one prefill forward, then one decode forward per step
/// for all rows. Each row stops at its own stop token or `max_tokens`.
pub fn greedy_batch(
    model: &Model,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    stop_tokens: &[u32],
) -> anyhow::Result<Vec<Vec<u32>>> {
    greedy_batch_in(model, None, prompts, max_tokens, stop_tokens)
}

/// [`greedy_batch`] with the batch's keys and values in `pool` when given
/// (a paged cache).
pub fn greedy_batch_in(
    model: &Model,
    pool: Option<&PagePool>,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    stop_tokens: &[u32],
) -> anyhow::Result<Vec<Vec<u32>>> {
    anyhow::ensure!(
        prompts.iter().all(|p| !p.is_empty()),
        "empty prompt in batch"
    );
    let (ids, pads) = left_padded(prompts.iter().map(Vec::as_slice), 0);
    let mut cache = match pool {
        Some(pool) => model.new_paged_cache(pool, pads),
        None => model.new_padded_cache(pads),
    };
    let logits = model.forward(&ids, &mut cache, Logits::Last)?;
    let mut current = argmax_tokens(&logits)?;
    let mut outs = vec![Vec::new(); prompts.len()];
    let mut done = vec![max_tokens == 0; prompts.len()];
    while !done.iter().all(|&d| d) {
        eval([&current])?;
        let step: Vec<i32> = current.as_slice::<i32>().to_vec();
        for (row, &t) in step.iter().enumerate() {
            if done[row] {
                continue;
            }
            if stop_tokens.contains(&(t as u32)) {
                done[row] = true;
            } else {
                outs[row].push(t as u32);
                done[row] = outs[row].len() >= max_tokens;
            }
        }
        if done.iter().all(|&d| d) {
            break;
        }
        let logits = model.forward(&current, &mut cache, Logits::Last)?;
        current = argmax_tokens(&logits)?;
    }
    Ok(outs)
}
