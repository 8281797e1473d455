//! Mixture-of-experts building blocks shared by the families with experts
//! (Gemma 4, Qwen3 MoE, Qwen 3.5 MoE): every expert's gated MLP stacked,
//! applied to the experts each token was routed to through MLX's gathered
//! matmuls (`gather_qmm` when quantized).

use mlx_rs::ops::indexing::{Ellipsis, TryIndexOp};
use mlx_rs::{ops, Array};

use crate::activations;
use crate::config::{ModelConfig, Quantization};
use crate::layers::quantized_shape;
use crate::weights::Weights;

type R<T> = Result<T, mlx_rs::error::Exception>;

/// Routing many (token, expert) pairs sorts them by expert first, so the
/// gathered matmuls read each expert's weights in one run (mlx-lm's
/// threshold, so both compute the same way).
const SORT_FROM: usize = 64;

/// Indices `[..., k]` of the `k` largest router scores of each token (in
/// the order `argpartition` leaves them, as mlx-lm takes them).
pub(crate) fn top_k(scores: &Array, k: i32) -> R<Array> {
    let experts = scores.dim(-1);
    let kth = experts - k;
    // A slice, not a gather of the last k positions: one graph node
    // instead of a host array and three nodes, in every MoE layer's step.
    ops::argpartition_axis(scores, kth, -1)?.try_index((Ellipsis, kth..experts))
}

/// One projection of every expert, `[experts, out, in]`.
enum SwitchLinear {
    Dense {
        /// `[experts, in, out]`: transposed once at load.
        weight_t: Array,
    },
    Quantized {
        weight: Array,
        scales: Array,
        biases: Array,
        group_size: i32,
        bits: i32,
    },
}

/// `down(act(gate(x)) * up(x))` of every expert.
pub(crate) struct SwitchGlu {
    gate_up: GateUp,
    down: SwitchLinear,
    gelu: bool,
}

/// Every expert's gate and up projections.
enum GateUp {
    /// Stacked on the output axis: one gathered matmul for both, and wide
    /// enough for MLX CUDA's tensor-core kernel (Gemma 4's 704-wide halves
    /// fell to its naive one, docs/benchmarks.md).
    Stacked { linear: SwitchLinear, inter: i32 },
    /// Quantized differently (a mixed-precision conversion): apart.
    Separate(SwitchLinear, SwitchLinear),
}

impl GateUp {
    fn new(gate: SwitchLinear, up: SwitchLinear, inter: i32) -> R<Self> {
        Ok(match SwitchLinear::stack(&gate, &up)? {
            Some(linear) => GateUp::Stacked { linear, inter },
            None => GateUp::Separate(gate, up),
        })
    }

    /// The gate's and the up projection's outputs.
    fn forward(&self, x: &Array, idx: &Array, sorted: bool) -> R<(Array, Array)> {
        match self {
            GateUp::Stacked { linear, inter } => {
                let both = linear.forward(x, idx, sorted)?;
                Ok((
                    both.try_index((Ellipsis, ..*inter))?,
                    both.try_index((Ellipsis, *inter..))?,
                ))
            }
            GateUp::Separate(gate, up) => {
                Ok((gate.forward(x, idx, sorted)?, up.forward(x, idx, sorted)?))
            }
        }
    }

    fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        match self {
            GateUp::Stacked { linear, .. } => linear.collect(out),
            GateUp::Separate(gate, up) => {
                gate.collect(out);
                up.collect(out);
            }
        }
    }
}

impl SwitchGlu {
    /// Hugging Face's fused layout: `{prefix}.gate_up_proj` (gate and up
    /// stacked on the output axis) and `{prefix}.down_proj`, no `.weight`.
    pub fn load_fused(
        w: &mut Weights,
        prefix: &str,
        (experts, inter, hidden): (i32, i32, i32),
        gelu: bool,
    ) -> anyhow::Result<Self> {
        let gate_up = w.take_shaped(
            &format!("{prefix}.gate_up_proj"),
            &[experts, 2 * inter, hidden],
        )?;
        let down = w.take_shaped(&format!("{prefix}.down_proj"), &[experts, hidden, inter])?;
        Ok(Self {
            gate_up: GateUp::Stacked {
                linear: SwitchLinear::dense(&gate_up)?,
                inter,
            },
            down: SwitchLinear::dense(&down)?,
            gelu,
        })
    }

    /// Hugging Face's per-expert layout: `{prefix}.{j}.{gate,up,down}_proj.weight`
    /// for every expert `j`, stacked here.
    pub fn load_per_expert(
        w: &mut Weights,
        prefix: &str,
        (experts, inter, hidden): (i32, i32, i32),
        gelu: bool,
    ) -> anyhow::Result<Self> {
        let stack = |w: &mut Weights, n: &str, shape: &[i32]| -> anyhow::Result<Array> {
            let parts = (0..experts)
                .map(|j| w.take_shaped(&format!("{prefix}.{j}.{n}.weight"), shape))
                .collect::<anyhow::Result<Vec<_>>>()?;
            Ok(ops::stack(&parts, 0)?)
        };
        let gate = stack(w, "gate_proj", &[inter, hidden])?;
        let up = stack(w, "up_proj", &[inter, hidden])?;
        Ok(Self {
            gate_up: GateUp::Stacked {
                linear: SwitchLinear::dense(&ops::concatenate(&[gate, up], 1)?)?,
                inter,
            },
            down: SwitchLinear::dense(&stack(w, "down_proj", &[hidden, inter])?)?,
            gelu,
        })
    }

    /// MLX conversions: `{prefix}.{gate,up,down}_proj` stacked tensors,
    /// optionally quantized.
    pub fn load_stacked(
        w: &mut Weights,
        cfg: &ModelConfig,
        prefix: &str,
        (experts, inter, hidden): (i32, i32, i32),
        gelu: bool,
    ) -> anyhow::Result<Self> {
        let load = |w: &mut Weights, n: &str, out: i32, inp: i32| {
            let p = format!("{prefix}.{n}");
            SwitchLinear::load(w, &p, cfg.quant_for(&p), experts, out, inp)
        };
        let gate = load(w, "gate_proj", inter, hidden)?;
        let up = load(w, "up_proj", inter, hidden)?;
        Ok(Self {
            gate_up: GateUp::new(gate, up, inter)?,
            down: load(w, "down_proj", hidden, inter)?,
            gelu,
        })
    }

    /// `[B, L, k, hidden]`: each token of `x` (`[B, L, hidden]`) through
    /// each of its k experts (`indices`, `[B, L, k]`).
    pub fn forward(&self, x: &Array, indices: &Array) -> R<Array> {
        let shape = indices.shape().to_vec();
        let x = x.expand_dims_axes(&[-2, -3])?;
        let sort = indices.size() >= SORT_FROM;
        let (x, idx, inverse) = if sort {
            let k = shape[shape.len() - 1];
            let flat = indices.flatten(None, None)?;
            let order = ops::argsort(&flat)?;
            let inverse = ops::argsort(&order)?;
            let rows = order.floor_divide(Array::from_int(k))?;
            let x = x.flatten(0, -3)?.take_axis(&rows, 0)?;
            (x, flat.take_axis(&order, 0)?, Some(inverse))
        } else {
            (x, indices.clone(), None)
        };
        let (gate, up) = self.gate_up.forward(&x, &idx, sort)?;
        let mut y = self
            .down
            .forward(&activations::gated(&gate, &up, self.gelu)?, &idx, sort)?;
        if let Some(inverse) = inverse {
            let mut unflat = shape.clone();
            unflat.extend_from_slice(&y.shape()[1..]);
            y = y.take_axis(&inverse, 0)?.reshape(&unflat)?;
        }
        y.squeeze_axes(&[-2])
    }

    pub fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        self.gate_up.collect(out);
        self.down.collect(out);
    }
}

impl SwitchLinear {
    fn dense(weight: &Array) -> R<Self> {
        Ok(SwitchLinear::Dense {
            weight_t: weight.swap_axes(-1, -2)?,
        })
    }

    /// `a` and `b` stacked on the output axis; `None` unless both are
    /// dense or both quantized alike.
    fn stack(a: &Self, b: &Self) -> R<Option<Self>> {
        let cat = |x: &Array, y: &Array, axis| ops::concatenate(&[x, y], axis);
        Ok(Some(match (a, b) {
            // Stacked as `[experts, out, in]`, then transposed back to a
            // view, as `dense` makes it.
            (SwitchLinear::Dense { weight_t: x }, SwitchLinear::Dense { weight_t: y }) => {
                let untransposed = |t: &Array| t.swap_axes(-1, -2);
                Self::dense(&cat(&untransposed(x)?, &untransposed(y)?, 1)?)?
            }
            (
                SwitchLinear::Quantized {
                    weight,
                    scales,
                    biases,
                    group_size,
                    bits,
                },
                SwitchLinear::Quantized {
                    weight: w2,
                    scales: s2,
                    biases: b2,
                    group_size: g2,
                    bits: bits2,
                },
            ) if (group_size, bits) == (g2, bits2) => SwitchLinear::Quantized {
                weight: cat(weight, w2, 1)?,
                scales: cat(scales, s2, 1)?,
                biases: cat(biases, b2, 1)?,
                group_size: *group_size,
                bits: *bits,
            },
            _ => return Ok(None),
        }))
    }

    fn load(
        w: &mut Weights,
        prefix: &str,
        quant: Option<Quantization>,
        experts: i32,
        out: i32,
        inp: i32,
    ) -> anyhow::Result<Self> {
        let name = format!("{prefix}.weight");
        let weight = w.take(&name)?;
        match w.take_optional(&format!("{prefix}.scales")) {
            None => {
                w.check_shape(&name, &weight, &[experts, out, inp])?;
                Ok(Self::dense(&weight)?)
            }
            Some(scales) => {
                let q = quant.ok_or_else(|| {
                    anyhow::anyhow!(
                        "tensor `{name}` in {} is quantized (it has scales) but config.json has no quantization for it",
                        w.file_of(&name)
                    )
                })?;
                let (packed, groups) =
                    quantized_shape(inp, q.group_size, q.bits).ok_or_else(|| {
                        anyhow::anyhow!(
                        "tensor `{name}` in {}: {inp} inputs do not split into {}-bit groups of {}",
                        w.file_of(&name), q.bits, q.group_size
                    )
                    })?;
                let biases = w.take(&format!("{prefix}.biases"))?;
                w.check_shape(&name, &weight, &[experts, out, packed])?;
                w.check_shape(
                    &format!("{prefix}.scales"),
                    &scales,
                    &[experts, out, groups],
                )?;
                w.check_shape(
                    &format!("{prefix}.biases"),
                    &biases,
                    &[experts, out, groups],
                )?;
                Ok(SwitchLinear::Quantized {
                    weight,
                    scales,
                    biases,
                    group_size: q.group_size,
                    bits: q.bits,
                })
            }
        }
    }

    /// `x`: `[..., 1, in]` rows, `idx`: the expert of each row's batch
    /// position. Returns `[..., 1, out]`.
    fn forward(&self, x: &Array, idx: &Array, sorted: bool) -> R<Array> {
        match self {
            SwitchLinear::Dense { weight_t } => ops::gather_mm(x, weight_t, None, idx, sorted),
            SwitchLinear::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
            } => ops::gather_qmm(
                x,
                weight,
                scales,
                biases,
                None,
                idx,
                true,
                *group_size,
                *bits,
                sorted,
            ),
        }
    }

    fn collect<'a>(&'a self, out: &mut Vec<&'a Array>) {
        match self {
            SwitchLinear::Dense { weight_t } => out.push(weight_t),
            SwitchLinear::Quantized {
                weight,
                scales,
                biases,
                ..
            } => out.extend([weight, scales, biases]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::tests::values;

    /// Every expert's projection `[experts, out, 64]`, quantized to `bits`.
    fn quantized(out: i32, bits: i32, seed: u64) -> SwitchLinear {
        mlx_rs::random::seed(seed).unwrap();
        let w = mlx_rs::random::normal::<f32>(&[4, out, 64], None, None, None).unwrap();
        let (weight, scales, biases) = ops::quantize(&w, 64, bits).unwrap();
        SwitchLinear::Quantized {
            weight,
            scales,
            biases,
            group_size: 64,
            bits,
        }
    }

    #[test]
    fn gate_and_up_stack_when_quantized_alike_and_compute_the_same() {
        // Three tokens, two experts each, as `SwitchGlu::forward` calls it.
        let x = mlx_rs::random::normal::<f32>(&[3, 1, 1, 1, 64], None, None, None).unwrap();
        let idx = Array::from_slice(&[0i32, 3, 1, 1, 2, 0], &[3, 1, 2]);
        let (gate, up) = (quantized(8, 4, 1), quantized(8, 4, 2));
        let apart = (
            gate.forward(&x, &idx, false).unwrap(),
            up.forward(&x, &idx, false).unwrap(),
        );
        let stacked = GateUp::new(gate, up, 8).unwrap();
        assert!(matches!(stacked, GateUp::Stacked { .. }));
        let (g, u) = stacked.forward(&x, &idx, false).unwrap();
        for (got, want) in [(&g, &apart.0), (&u, &apart.1)] {
            assert_eq!(got.shape(), want.shape());
            for (a, b) in values(got).iter().zip(values(want)) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
        }

        // A mixed-precision conversion's gate and up stay apart.
        let mixed = GateUp::new(quantized(8, 4, 1), quantized(8, 8, 2), 8).unwrap();
        assert!(matches!(mixed, GateUp::Separate(..)));
        let (g, u) = mixed.forward(&x, &idx, false).unwrap();
        assert_eq!((g.shape(), u.shape()), (apart.0.shape(), apart.1.shape()));
    }
}
