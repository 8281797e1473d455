//! Sampling on the device, one row of logits at a time (the batched engine
//! takes a fast argmax over the whole batch when every row is greedy).
//!
//! Order, as in vLLM/HF: logit_bias, repetition penalty (over prompt and
//! output), presence/frequency penalties (over output, OpenAI semantics),
//! temperature, then top-k, min-p and top-p truncation, then a categorical
//! draw with the request's own PRNG key (same seed, same output).

use engine_core::SamplingParams;
use mlx_rs::{ops, random, Array, Dtype};

type R<T> = Result<T, mlx_rs::error::Exception>;

pub struct Sampler {
    params: SamplingParams,
    vocab: i32,
    /// Dense `[V]` logit bias, built once.
    bias: Option<Array>,
    /// `[V]` counts of generated tokens, updated per token on the device.
    counts: Option<Array>,
    /// `[V]` 1.0 where the token appeared in prompt or output.
    seen: Option<Array>,
    key: Option<Array>,
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
        let key = if params.is_greedy() {
            None
        } else {
            let seed = params.seed.unwrap_or_else(random_seed);
            Some(random::key(seed)?)
        };
        Ok(Self {
            params: params.clone(),
            vocab,
            bias,
            counts,
            seen,
            key,
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

    /// Logits after bias and penalties, before temperature: what logprobs
    /// are reported from.
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
        let l = self.adjust(&logits.reshape(&[1, self.vocab])?)?;
        self.pick(l)
    }

    /// [`Sampler::sample`] among the tokens a grammar allows (`allowed`:
    /// `[V]` bool, see [`allowed_mask`]); the others get no probability.
    pub fn sample_within(&mut self, logits: &Array, allowed: &Array) -> R<Array> {
        let l = self.adjust(&logits.reshape(&[1, self.vocab])?)?;
        self.pick(ops::select(allowed, &l, neg_inf())?)
    }

    fn pick(&mut self, l: Array) -> R<Array> {
        if self.params.is_greedy() {
            return ops::indexing::argmax_axis(&l, -1, None);
        }
        let key = self.key.take().expect("sampled rows have a key");
        let (next_key, draw_key) = random::split(&key, 2)?;
        self.key = Some(next_key);
        random::categorical(&self.truncate(l)?, -1, None, &draw_key)
    }

    /// Temperature, then top-k, min-p and top-p: the logits a sampled
    /// token is drawn from.
    fn truncate(&self, l: Array) -> R<Array> {
        let mut l = l.multiply(Array::from_f32(1.0 / self.params.temperature))?;
        if self.params.top_k > 0 && (self.params.top_k as i32) < self.vocab {
            l = top_k(&l, self.params.top_k as i32)?;
        }
        if self.params.min_p > 0.0 {
            l = min_p(&l, self.params.min_p)?;
        }
        if self.params.top_p < 1.0 {
            l = top_p(&l, self.params.top_p)?;
        }
        Ok(l)
    }

    /// The picks [`Sampler::sample`] (or [`Sampler::sample_within`] where
    /// `allowed` gives a row's set) would make at the next `L` positions
    /// of `[1, L, V]` logits, position `i` as if `ahead[..i]` had been
    /// chosen before it: each row draws with the key its turn would have,
    /// so a token kept from here equals the one plain sampling draws with
    /// the same seed. Nothing is consumed; [`Sampler::advance`] then moves
    /// past the tokens kept. Returns the `L` picks as lazy int32 arrays
    /// that, concatenated in order, are the picks: one `[L]` array where
    /// every pick is an argmax, else one `[1]` array a position, so a
    /// caller can evaluate them in order and stop at the first pick it
    /// will not keep (a draw from the vocabulary, on the CPU, costs about
    /// a sixth of a decode step of the default model: its random bits).
    pub fn picks_along(
        &self,
        logits: &Array,
        ahead: &[u32],
        allowed: &[Option<Array>],
    ) -> R<Vec<Array>> {
        let positions = logits.dim(1);
        let logits = logits.reshape(&[positions, self.vocab])?;
        if self.params.is_greedy() && !self.reads_history() && self.bias.is_none() {
            let l = match allowed.iter().any(Option::is_some) {
                false => logits,
                true => {
                    let rows = (0..positions as usize)
                        .map(|i| self.within(&row(&logits, i)?, allowed.get(i)))
                        .collect::<R<Vec<_>>>()?;
                    ops::concatenate(&rows, 0)?
                }
            };
            return Ok(vec![
                ops::indexing::argmax_axis(&l, -1, None)?.as_dtype(Dtype::Int32)?
            ]);
        }
        let mut key = self.key.clone();
        let mut picks = Vec::with_capacity(positions as usize);
        for i in 0..positions as usize {
            let before = &ahead[..i.min(ahead.len())];
            let l = self.within(
                &self.adjust_after(&row(&logits, i)?, before)?,
                allowed.get(i),
            )?;
            let pick = match key.take() {
                None => ops::indexing::argmax_axis(&l, -1, None)?,
                Some(k) => {
                    let (next_key, draw_key) = random::split(&k, 2)?;
                    key = Some(next_key);
                    random::categorical(&self.truncate(l)?, -1, None, &draw_key)?
                }
            };
            picks.push(pick.as_dtype(Dtype::Int32)?);
        }
        match self.key {
            None => Ok(vec![ops::concatenate(&picks, 0)?]),
            Some(_) => Ok(picks),
        }
    }

    /// `l` with the tokens outside `allowed` (when given) at no probability.
    fn within(&self, l: &Array, allowed: Option<&Option<Array>>) -> R<Array> {
        match allowed {
            Some(Some(allowed)) => ops::select(allowed, l, neg_inf()),
            _ => Ok(l.clone()),
        }
    }

    /// Moves past `tokens` chosen from [`Sampler::picks_along`]: each is
    /// observed and takes its position's key, as [`Sampler::sample`]'s
    /// picks do.
    pub fn advance(&mut self, tokens: &[u32]) -> R<()> {
        for &t in tokens {
            self.pass_key()?;
            self.observe(t)?;
        }
        Ok(())
    }

    /// Moves the key past one position, as a draw there would: for a
    /// token chosen from [`Sampler::picks_along`], which
    /// [`Sampler::observe`] then records.
    pub fn pass_key(&mut self) -> R<()> {
        if let Some(key) = self.key.take() {
            let (next_key, _) = random::split(&key, 2)?;
            self.key = Some(next_key);
        }
        Ok(())
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

fn top_k(l: &Array, k: i32) -> R<Array> {
    let v = l.dim(-1);
    let sorted = ops::sort_axis(l, -1)?;
    let kth = sorted.take_axis(Array::from_slice(&[v - k], &[1]), -1)?;
    ops::select(&l.lt(&kth)?, neg_inf(), l)
}

fn min_p(l: &Array, p: f32) -> R<Array> {
    // probs < p * max_prob  <=>  logit < max_logit + ln(p)
    let max = l.max_axis(-1, true)?;
    let threshold = max.add(Array::from_f32(p.ln()))?;
    ops::select(&l.lt(&threshold)?, neg_inf(), l)
}

fn top_p(l: &Array, p: f32) -> R<Array> {
    // Keep the smallest set of most likely tokens whose mass reaches p: a
    // token survives when the mass strictly above it is below p.
    let probs = ops::softmax_axis(l, -1, None)?;
    let sorted = ops::sort_axis(&probs, -1)?; // ascending
    let cum = ops::cumsum(&sorted, -1, None, None)?;
    let above = Array::from_f32(1.0).subtract(&cum)?; // mass strictly above each sorted entry
    let keep = above.lt(Array::from_f32(p))?;
    let threshold =
        ops::select(&keep, &sorted, Array::from_f32(f32::INFINITY))?.min_axis(-1, true)?;
    ops::select(&probs.lt(&threshold)?, neg_inf(), l)
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
