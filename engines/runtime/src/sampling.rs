//! Sampling on the device: every row of a batch (or every position of a
//! verified block) drawn by one set of nodes ([`draw`]), whatever each
//! row's parameters.
//!
//! Order, as in vLLM/HF: logit_bias, repetition penalty (over prompt and
//! output), presence/frequency penalties (over output, OpenAI semantics),
//! temperature, then top-k, min-p and top-p truncation, then a categorical
//! draw: the Gumbel-max argmax, the noise of a request's `i`-th draw a hash
//! of its seed, `i` and the token id (same seed, same output; any draw of
//! a request can be built ahead without the ones before it).

use engine_core::SamplingParams;
use mlx_rs::error::Exception;
use mlx_rs::{ops, Array, Dtype};

type R<T> = Result<T, Exception>;

pub struct Sampler {
    params: SamplingParams,
    vocab: i32,
    /// Dense `[V]` logit bias, built once.
    bias: Option<Array>,
    /// `[V]` counts of generated tokens, updated per token on the device.
    counts: Option<Array>,
    /// `[V]` 1.0 where the token appeared in prompt or output.
    seen: Option<Array>,
    /// A sampled request's seed (`None`: greedy).
    seed: Option<u64>,
    /// The index of its next draw: the tokens chosen so far.
    drawn: u64,
}

/// How one row's token is chosen from its adjusted logits by [`draw`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    /// The row's noise (`None`: its argmax).
    key: Option<u64>,
    inv_temperature: f32,
    /// 0: no top-k.
    top_k: i32,
    min_p: f32,
    /// `f32::INFINITY`: no top-p.
    top_p: f32,
}

impl Pick {
    /// The argmax, untruncated.
    pub const GREEDY: Pick = Pick {
        key: None,
        inv_temperature: 1.0,
        top_k: 0,
        min_p: 0.0,
        top_p: f32::INFINITY,
    };

    fn truncates(&self) -> [bool; 3] {
        [self.top_k > 0, self.min_p > 0.0, self.top_p.is_finite()]
    }
}

impl Sampler {
    pub fn new(params: &SamplingParams, vocab: i32, prompt: &[u32]) -> R<Self> {
        let bias = if params.logit_bias.is_empty() {
            None
        } else {
            let mut dense = vec![0f32; vocab as usize];
            for &(id, b) in &params.logit_bias {
                if (id as i32) < vocab {
                    dense[id as usize] += b;
                }
            }
            Some(Array::from_slice(&dense, &[vocab]))
        };
        let needs_counts = params.presence_penalty != 0.0 || params.frequency_penalty != 0.0;
        let counts = needs_counts
            .then(|| ops::zeros::<f32>(&[vocab]))
            .transpose()?;
        let seen = if params.repetition_penalty != 1.0 {
            let mut dense = vec![0f32; vocab as usize];
            for &t in prompt {
                if (t as i32) < vocab {
                    dense[t as usize] = 1.0;
                }
            }
            Some(Array::from_slice(&dense, &[vocab]))
        } else {
            None
        };
        let seed = (!params.is_greedy()).then(|| params.seed.unwrap_or_else(random_seed));
        Ok(Self {
            params: params.clone(),
            vocab,
            bias,
            counts,
            seen,
            seed,
            drawn: 0,
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether the next pick depends on the tokens chosen so far
    /// (penalties): each token must be [`Sampler::observe`]d, on the host,
    /// before the next pick is built.
    pub fn reads_history(&self) -> bool {
        self.counts.is_some() || self.seen.is_some()
    }

    /// Whether [`Sampler::adjust`] changes the logits (bias, penalties).
    pub fn adjusts(&self) -> bool {
        self.bias.is_some() || self.reads_history()
    }

    /// Logits after bias and penalties, before temperature: what logprobs
    /// are reported from and what [`Sampler::next_pick`] draws from.
    pub fn adjust(&self, logits: &Array) -> R<Array> {
        self.adjust_after(logits, &[])
    }

    /// The log-probabilities a token's logprobs are reported from (after
    /// bias and penalties, before temperature and truncation), of one row
    /// of logits, flat; read them with [`token_logprobs`].
    pub fn logprobs(&self, logits: &Array) -> R<Array> {
        log_softmax(&self.adjust(logits)?)?.reshape(&[-1])
    }

    /// [`Sampler::adjust`] as it will be once `ahead` (tokens not yet
    /// [`Sampler::observe`]d, e.g. drafts under verification) are chosen.
    fn adjust_after(&self, logits: &Array, ahead: &[u32]) -> R<Array> {
        let mut l = logits.clone();
        if let Some(b) = &self.bias {
            l = l.add(b)?;
        }
        if let Some(seen) = &self.seen {
            let mut seen = seen.clone();
            for &t in ahead {
                seen = ops::maximum(&seen, self.one_hot(t)?)?;
            }
            // HF/vLLM rule: shrink positive logits, grow negative ones.
            let p = Array::from_f32(self.params.repetition_penalty);
            let penalised = ops::select(
                &l.gt(Array::from_f32(0.0))?,
                &l.divide(&p)?,
                &l.multiply(&p)?,
            )?;
            l = ops::select(&seen.gt(Array::from_f32(0.0))?, &penalised, &l)?;
        }
        if let Some(counts) = &self.counts {
            let mut counts = counts.clone();
            for &t in ahead {
                counts = counts.add(self.one_hot(t)?)?;
            }
            let presence = counts.gt(Array::from_f32(0.0))?.as_dtype(Dtype::Float32)?;
            let penalty = presence
                .multiply(Array::from_f32(self.params.presence_penalty))?
                .add(counts.multiply(Array::from_f32(self.params.frequency_penalty))?)?;
            l = l.subtract(&penalty)?;
        }
        Ok(l)
    }

    /// Picks the next token from `[1, V]` (or `[V]`) float32 logits; returns
    /// a lazy `[1]` uint32 array.
    pub fn sample(&mut self, logits: &Array) -> R<Array> {
        let pick = self.next_pick();
        self.draw_as(logits, None, pick)
    }

    /// [`Sampler::sample`] among the tokens a grammar allows (`allowed`:
    /// `[V]` bool, see [`allowed_mask`]); the others get no probability.
    pub fn sample_within(&mut self, logits: &Array, allowed: &Array) -> R<Array> {
        let pick = self.next_pick();
        self.draw_as(logits, Some(allowed), pick)
    }

    /// The token `pick` (a [`Sampler::next_pick`] already taken) draws from
    /// `[1, V]` (or `[V]`) logits, within `allowed` where given; a lazy `[1]`
    /// uint32 array.
    pub fn draw_as(&self, logits: &Array, allowed: Option<&Array>, pick: Pick) -> R<Array> {
        let l = self.drawn_from(&logits.reshape(&[1, self.vocab])?, allowed)?;
        draw(&l, &[pick])
    }

    /// The logits its next pick is drawn from: adjusted, and without the
    /// tokens outside `allowed` (a grammar's set) when given.
    pub fn drawn_from(&self, logits: &Array, allowed: Option<&Array>) -> R<Array> {
        let l = self.adjust(logits)?;
        match allowed {
            Some(allowed) => ops::select(allowed, &l, neg_inf()),
            None => Ok(l),
        }
    }

    /// How its next token is drawn from its adjusted logits, the draw
    /// taken: for a caller that draws it with other rows' ([`draw`]).
    pub fn next_pick(&mut self) -> Pick {
        let pick = self.pick_at(0);
        self.pass_draw();
        pick
    }

    /// How the draw `ahead` places after the next one is made.
    fn pick_at(&self, ahead: u64) -> Pick {
        let Some(seed) = self.seed else {
            return Pick::GREEDY;
        };
        let p = &self.params;
        Pick {
            key: Some(splitmix64(seed ^ splitmix64(self.drawn + ahead))),
            inv_temperature: 1.0 / p.temperature,
            top_k: match p.top_k as i32 {
                k if k > 0 && k < self.vocab => k,
                _ => 0,
            },
            min_p: p.min_p.max(0.0),
            top_p: if p.top_p < 1.0 {
                p.top_p
            } else {
                f32::INFINITY
            },
        }
    }

    /// The picks [`Sampler::sample`] (or [`Sampler::sample_within`] where
    /// `allowed` gives a row's set) would make at the next `L` positions
    /// of `[1, L, V]` logits, position `i` as if `ahead[..i]` had been
    /// chosen before it, with the draw its turn would have: a token kept
    /// from here equals the one plain sampling draws with the same seed.
    /// Nothing is consumed; [`Sampler::advance`] then moves past the
    /// tokens kept. Returns the `[L]` int32 picks, lazily.
    pub fn picks_along(
        &self,
        logits: &Array,
        ahead: &[u32],
        allowed: &[Option<Array>],
    ) -> R<Array> {
        let positions = logits.dim(1);
        let logits = logits.reshape(&[positions, self.vocab])?;
        let l = if self.reads_history() || allowed.iter().any(Option::is_some) {
            let rows = (0..positions as usize)
                .map(|i| {
                    let before = &ahead[..i.min(ahead.len())];
                    let l = self.adjust_after(&row(&logits, i)?, before)?;
                    match allowed.get(i) {
                        Some(Some(allowed)) => ops::select(allowed, &l, neg_inf()),
                        _ => Ok(l),
                    }
                })
                .collect::<R<Vec<_>>>()?;
            ops::concatenate(&rows, 0)?
        } else {
            self.adjust(&logits)?
        };
        let picks: Vec<Pick> = (0..positions as u64).map(|i| self.pick_at(i)).collect();
        draw(&l, &picks)?.as_dtype(Dtype::Int32)
    }

    /// Moves past `tokens` chosen from [`Sampler::picks_along`]: each is
    /// observed and takes its position's draw, as [`Sampler::sample`]'s
    /// picks do.
    pub fn advance(&mut self, tokens: &[u32]) -> R<()> {
        for &t in tokens {
            self.pass_draw();
            self.observe(t)?;
        }
        Ok(())
    }

    /// Moves past one position's draw, as a draw there would: for a token
    /// chosen from [`Sampler::picks_along`], which [`Sampler::observe`]
    /// then records.
    pub fn pass_draw(&mut self) {
        self.drawn += 1;
    }

    /// Records the chosen token for the penalties.
    pub fn observe(&mut self, token: u32) -> R<()> {
        if token as i32 >= self.vocab {
            return Ok(());
        }
        if self.counts.is_none() && self.seen.is_none() {
            return Ok(());
        }
        let one_hot = self.one_hot(token)?;
        if let Some(c) = &self.counts {
            self.counts = Some(c.add(&one_hot)?);
        }
        if let Some(s) = &self.seen {
            self.seen = Some(ops::maximum(s, &one_hot)?);
        }
        Ok(())
    }

    /// `[V]` float32: 1.0 at `token`.
    fn one_hot(&self, token: u32) -> R<Array> {
        Array::arange::<_, i32>(0, self.vocab, 1)?
            .eq(Array::from_int(token as i32))?
            .as_dtype(Dtype::Float32)
    }
}

/// The token of every row of `[N, V]` adjusted logits, row `n` chosen as
/// `picks[n]` says: temperature, then top-k, min-p and top-p (each built
/// only where some row asks for it, a row that does not left whole), then
/// the argmax plus the row's Gumbel noise (none for a greedy row), which is
/// a draw from the truncated softmax. One set of nodes for every row: a
/// batch's sampling costs what one row's does. Returns `[N]` uint32, lazily.
pub fn draw(logits: &Array, picks: &[Pick]) -> R<Array> {
    let n = picks.len() as i32;
    if picks.iter().all(|p| *p == Pick::GREEDY) {
        return ops::indexing::argmax_axis(logits, -1, None);
    }
    let column = |f: &dyn Fn(&Pick) -> f32| {
        Array::from_slice(&picks.iter().map(f).collect::<Vec<f32>>(), &[n, 1])
    };
    let mut l = logits
        .as_dtype(Dtype::Float32)?
        .multiply(column(&|p| p.inv_temperature))?;
    let vocab = l.dim(-1);
    let asked = |i: usize| picks.iter().any(|p| p.truncates()[i]);
    if asked(0) {
        // The k-th largest, the smallest where a row keeps every token.
        let at: Vec<i32> = picks
            .iter()
            .map(|p| if p.top_k > 0 { vocab - p.top_k } else { 0 })
            .collect();
        let kth = ops::sort_axis(&l, -1)?.take_along_axis(&Array::from_slice(&at, &[n, 1]), -1)?;
        l = ops::select(&l.lt(&kth)?, neg_inf(), &l)?;
    }
    if asked(1) {
        // probs < p * max_prob  <=>  logit < max_logit + ln(p); ln(0) = -inf.
        let threshold = l.max_axis(-1, true)?.add(column(&|p| p.min_p.ln()))?;
        l = ops::select(&l.lt(&threshold)?, neg_inf(), &l)?;
    }
    if asked(2) {
        // Keep the smallest set of most likely tokens whose mass reaches p:
        // a token survives when the mass strictly above it is below p (an
        // infinite p keeps every token).
        let probs = ops::softmax_axis(&l, -1, None)?;
        let sorted = ops::sort_axis(&probs, -1)?; // ascending
        let above = Array::from_f32(1.0).subtract(ops::cumsum(&sorted, -1, None, None)?)?;
        let keep = above.lt(column(&|p| p.top_p))?;
        let threshold =
            ops::select(&keep, &sorted, Array::from_f32(f32::INFINITY))?.min_axis(-1, true)?;
        l = ops::select(&probs.lt(&threshold)?, neg_inf(), &l)?;
    }
    let keys: Vec<u64> = picks.iter().map(|p| p.key.unwrap_or(0)).collect();
    let mut noise = gumbel(&Array::from_slice(&keys, &[n, 1]), vocab)?;
    if picks.iter().any(|p| p.key.is_none()) {
        noise = noise.multiply(column(&|p| p.key.map_or(0.0, |_| 1.0)))?;
    }
    ops::indexing::argmax_axis(&l.add(&noise)?, -1, None)
}

/// `[N, V]` standard Gumbel noise, row `n`'s token `j` from the `j`-th
/// output of splitmix64 started at `keys[n]` (`[N, 1]` uint64): a stream
/// that passes BigCrush, built from elementwise nodes on any device.
fn gumbel(keys: &Array, vocab: i32) -> R<Array> {
    let c = |v: u64| Array::from_slice(&[v], &[1]);
    let j = Array::arange::<_, i32>(1, vocab + 1, 1)?.as_dtype(Dtype::Uint64)?;
    let mut z = keys.add(j.multiply(c(GOLDEN))?)?;
    for (shift, mul) in [(30, MIX1), (27, MIX2)] {
        z = xor_shifted(&z, shift)?.multiply(c(mul))?;
    }
    z = xor_shifted(&z, 31)?;
    // The top 24 bits, as a uniform in (0, 1) that float32 holds exactly.
    let u = bits_op(mlx_sys::mlx_right_shift, &z, &c(40))?
        .as_dtype(Dtype::Float32)?
        .add(Array::from_f32(0.5))?
        .multiply(Array::from_f32(1.0 / (1u32 << 24) as f32))?;
    ops::log(&ops::log(&u)?.negative()?)?.negative()
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
const MIX1: u64 = 0xBF58_476D_1CE4_E5B9;
const MIX2: u64 = 0x94D0_49BB_1331_11EB;

/// splitmix64's output for state `x` (before the increment): the host's
/// copy of what [`gumbel`] computes per token, to derive draw keys.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(MIX1);
    z = (z ^ (z >> 27)).wrapping_mul(MIX2);
    z ^ (z >> 31)
}

/// `z ^ (z >> shift)`.
fn xor_shifted(z: &Array, shift: u64) -> R<Array> {
    let shifted = bits_op(
        mlx_sys::mlx_right_shift,
        z,
        &Array::from_slice(&[shift], &[1]),
    )?;
    bits_op(mlx_sys::mlx_bitwise_xor, z, &shifted)
}

/// One of mlx-c's integer binary ops, which mlx-rs does not wrap.
fn bits_op(
    op: unsafe extern "C" fn(
        *mut mlx_sys::mlx_array,
        mlx_sys::mlx_array,
        mlx_sys::mlx_array,
        mlx_sys::mlx_stream,
    ) -> std::os::raw::c_int,
    a: &Array,
    b: &Array,
) -> R<Array> {
    let stream = mlx_rs::Stream::thread_local_or_default();
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        if op(&mut res, a.as_ptr(), b.as_ptr(), stream.as_ptr()) != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(Exception::custom("mlx integer operation failed"));
        }
        Ok(Array::from_ptr(res))
    }
}

/// Row `i` of `[L, V]` logits, as `[1, V]`.
fn row(logits: &Array, i: usize) -> R<Array> {
    logits.take_axis(Array::from_slice(&[i as i32], &[1]), 0)
}

/// A grammar's allowed set as a `[V]` bool array for
/// [`Sampler::sample_within`].
pub fn allowed_mask(allowed: &[bool]) -> Array {
    Array::from_slice(allowed, &[allowed.len() as i32])
}

/// Log-probabilities of `[.., V]` logits.
pub fn log_softmax(logits: &Array) -> R<Array> {
    logits.subtract(ops::logsumexp_axis(logits, -1, true)?)
}

/// A token's log-probabilities as reported: `token`'s in `logprobs` (one
/// row, evaluated, from [`Sampler::logprobs`]) and the `top` most likely
/// tokens', most likely first.
pub fn token_logprobs(logprobs: &[f32], token: u32, top: usize) -> (Option<f32>, Vec<(u32, f32)>) {
    let chosen = logprobs.get(token as usize).copied();
    let k = top.min(logprobs.len());
    if k == 0 {
        return (chosen, Vec::new());
    }
    let mut order: Vec<u32> = (0..logprobs.len() as u32).collect();
    let descending = |a: &u32, b: &u32| logprobs[*b as usize].total_cmp(&logprobs[*a as usize]);
    order.select_nth_unstable_by(k - 1, descending);
    order.truncate(k);
    order.sort_by(descending);
    let best = order
        .into_iter()
        .map(|t| (t, logprobs[t as usize]))
        .collect();
    (chosen, best)
}

fn neg_inf() -> Array {
    Array::from_f32(f32::NEG_INFINITY)
}

fn random_seed() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, std::sync::atomic::Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::token_logprobs;

    #[test]
    fn a_tokens_logprobs_and_the_most_likely_first() {
        let lp = [-2.0, -0.5, -3.0, -1.0, -0.75];
        assert_eq!(
            token_logprobs(&lp, 2, 3),
            (Some(-3.0), vec![(1, -0.5), (4, -0.75), (3, -1.0)])
        );
        assert_eq!(token_logprobs(&lp, 0, 0), (Some(-2.0), vec![]));
        assert_eq!(
            token_logprobs(&lp, 9, 9).1.len(),
            5,
            "at most the vocabulary"
        );
    }
}
