//! Greedy tokens and logits against the reference implementation, Python
//! mlx-lm, on the same generated weights (installed by scripts/setup into
//! .mlx/venv). Every family, fp32, bf16 and 4/8-bit quantized, single
//! sequences and a left-padded batch of mixed prompt lengths; and with
//! `model.kv_cache` (quantized full-attention KV) against mlx-lm's
//! `QuantizedKVCache` with the same bits and group size.

use std::path::Path;

use fixtures::model::{write_model, TinySpec};
use fixtures::reference::worst_difference;
use mlx_rs::Dtype;
use runtime::config::ModelConfig;
use runtime::generate::{self, prefill};
use runtime::mask::{set_ragged_attention, RaggedAttention};
use runtime::model::{Logits, Model};
use runtime::weights::Weights;
use runtime::{ComputeDtype, Family, KvQuant};

const STEPS: usize = 64;

struct Reference {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

/// mlx-lm's greedy run; `cast` casts its floating-point parameters first,
/// `kv` quantizes its full-attention caches.
fn reference(
    dir: &Path,
    prompts: &[Vec<u32>],
    steps: usize,
    logits: bool,
    cast: Option<&str>,
    kv: Option<KvQuant>,
) -> Vec<Reference> {
    let req = serde_json::json!({ "model": dir, "prompts": prompts, "max_tokens": steps, "logits": logits, "dtype": cast,
        "kv_bits": kv.map(|q| q.bits), "kv_group_size": kv.map(|q| q.group_size) });
    let v = fixtures::reference::run("mlx_lm_oracle.py", &req);
    v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| Reference {
            tokens: fixtures::reference::token_ids(&r["tokens"]),
            logits: fixtures::reference::float_rows(&r["logits"]),
        })
        .collect()
}

/// The model, its floating-point weights cast to `compute` (as
/// `model.compute_dtype` does at load), its packed weights expanded when
/// `expand` (as `auto` does on the CPU where they fit).
/// What becomes of a checkpoint's packed weights at load.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Packed {
    Kept,
    /// Expanded to the compute dtype, as `float32` does on the CPU where
    /// they fit (and `auto` where the packed kernel cannot take them).
    Expanded,
    /// Kept, the decoder layers' linears also expanded for products of
    /// several rows, as `auto` does on a GPU for a mixture of experts.
    WithCopies,
}

fn load(dir: &Path, compute: Option<Dtype>, packed: Packed) -> Model {
    let config = ModelConfig::from_dir(dir).unwrap();
    let mut weights = Weights::from_dir(dir).unwrap();
    if let Some(dtype) = compute {
        // As the loader under `auto` on the CPU: packed layers with half-
        // precision scales keep them in fp16 for the kernel.
        let takes_all = weights.packed_kernel_takes_all(&config);
        if matches!(packed, Packed::Kept) && ComputeDtype::Auto.keeps_half_scales(takes_all) {
            weights.keep_half_scales(&config).unwrap();
        }
        weights.cast_floats(dtype).unwrap();
    }
    match packed {
        Packed::Kept => {}
        Packed::Expanded => {
            assert!(ComputeDtype::Float32.expands_packed(
                weights.expanded_bytes(&config),
                weights.packed_kernel_takes_all(&config)
            ));
            weights.expand_packed(&config).unwrap();
            assert_eq!(weights.expanded_bytes(&config), 0, "nothing left packed");
        }
        Packed::WithCopies => {
            let copies = weights.dense_copy_bytes(&config);
            assert!(
                copies > 0 && copies < weights.expanded_bytes(&config),
                "the decoder layers' linears are copied, the experts are not"
            );
            weights.keep_dense_copies();
        }
    }
    Model::load(config, weights).unwrap()
}

/// Our greedy decode after a prefill in forwards of `chunk` tokens, step
/// by step, keeping every step's logits.
fn ours(model: &Model, prompt: &[u32], steps: usize, chunk: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut cache = model.new_cache(1);
    let mut logits = prefill(model, &mut cache, prompt, chunk).unwrap();
    let (mut tokens, mut rows) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let row: Vec<f32> = logits.reshape(&[-1]).unwrap().as_slice::<f32>().to_vec();
        let token = row
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        tokens.push(token);
        rows.push(row);
        logits = model
            .forward(&generate::tokens_array(&[token]), &mut cache, Logits::Last)
            .unwrap();
    }
    (tokens, rows)
}

fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    // Lengths straddle the Gemma window (24) and the prefill chunk (7)
    // used above.
    prompts_of(vocab, &[5, 17, 30, 9])
}

/// Deterministic pseudo-random ids.
fn prompts_of(vocab: u32, lengths: &[usize]) -> Vec<Vec<u32>> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    lengths
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % vocab as u64) as u32
                })
                .collect()
        })
        .collect()
}

fn check_family(spec: TinySpec, logit_tol: Option<f32>) {
    check_computed_in(spec, logit_tol, None)
}

fn check_computed_in(spec: TinySpec, logit_tol: Option<f32>, compute: Option<Dtype>) {
    check(spec, logit_tol, compute, None, Packed::Kept)
}

/// Ours with the checkpoint's floats cast to `compute` and full-attention
/// KV quantized with `kv` against mlx-lm with its parameters cast and its
/// caches quantized the same way.
fn check(
    spec: TinySpec,
    logit_tol: Option<f32>,
    compute: Option<Dtype>,
    kv: Option<KvQuant>,
    packed: Packed,
) {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &spec).unwrap();
    let mut model = load(dir.path(), compute, packed);
    model.set_kv_quant(kv).unwrap();
    let prompts = prompts(spec.vocab as u32);
    let cast = compute.map(|d| match d {
        Dtype::Float32 => "float32",
        Dtype::Bfloat16 => "bfloat16",
        Dtype::Float16 => "float16",
        other => unreachable!("not a compute dtype: {other:?}"),
    });
    let refs = reference(dir.path(), &prompts, STEPS, logit_tol.is_some(), cast, kv);
    let label = format!(
        "{:?} {:?} q{:?} computed in {:?}, packed weights {packed:?}, KV {kv:?}",
        spec.family, spec.dtype, spec.quant_bits, compute
    );
    for (i, (prompt, r)) in prompts.iter().zip(&refs).enumerate() {
        let (tokens, rows) = ours(&model, prompt, STEPS, 7);
        assert_eq!(
            tokens, r.tokens,
            "{label}: prompt {i} greedy tokens differ from mlx-lm"
        );
        if let Some(tol) = logit_tol {
            let worst = worst_difference(&rows, &r.logits);
            assert!(
                worst < tol,
                "{label}: prompt {i} logits differ by {worst} (tolerance {tol})"
            );
            if kv.is_some() && i == 0 {
                // The reference's quantization shows: the same model with
                // its KV in fp32 is further off than the tolerance.
                model.set_kv_quant(None).unwrap();
                let (_, dense) = ours(&model, prompt, STEPS, 7);
                model.set_kv_quant(kv).unwrap();
                let off = worst_difference(&dense, &r.logits);
                assert!(off > tol, "{label}: unquantized KV is only {off} off");
                eprintln!("{label}: logits within {worst} (unquantized KV: {off})");
            }
        }
        // The production loop (pipelined, chunked prefill) gives the same.
        let run = generate::greedy(&model, prompt, STEPS, &[], |_| true).unwrap();
        assert_eq!(
            run.tokens, r.tokens,
            "{label}: prompt {i} generate::greedy differs"
        );
    }
    // Both ways a padded batch can decode: a mask array, or the ragged
    // attention GPUs run as one kernel (here its reference path).
    for mode in [RaggedAttention::Never, RaggedAttention::Always] {
        set_ragged_attention(mode);
        let batched = generate::greedy_batch(&model, &prompts, STEPS, &[]).unwrap();
        set_ragged_attention(RaggedAttention::Auto);
        for (i, (b, r)) in batched.iter().zip(&refs).enumerate() {
            assert_eq!(
                b, &r.tokens,
                "{label}: prompt {i} differs when decoded in a padded batch ({mode:?})"
            );
        }
    }
}

#[test]
fn llama_matches_mlx_lm() {
    check_family(TinySpec::tiny(Family::Llama), Some(1e-3));
}

#[test]
fn qwen2_matches_mlx_lm() {
    check_family(TinySpec::tiny(Family::Qwen2), Some(1e-3));
}

#[test]
fn qwen3_matches_mlx_lm() {
    check_family(TinySpec::tiny(Family::Qwen3), Some(1e-3));
}

#[test]
fn gemma3_matches_mlx_lm() {
    check_family(TinySpec::tiny(Family::Gemma3), Some(1e-3));
}

#[test]
fn quantized_and_bf16_match_mlx_lm() {
    for bits in [4, 8] {
        let spec = TinySpec {
            quant_bits: Some(bits),
            ..TinySpec::tiny(Family::Qwen3)
        };
        check_family(spec, None);
    }
    let spec = TinySpec {
        dtype: Dtype::Bfloat16,
        ..TinySpec::tiny(Family::Llama)
    };
    check_family(spec, None);
}

/// `model.compute_dtype: auto` on the CPU: a bf16 checkpoint upcast to fp32
/// at load, and a 4-bit one whose scales and biases are, match mlx-lm
/// running the same weights cast to fp32, tokens and logits.
#[test]
fn checkpoints_upcast_to_fp32_match_mlx_lm_in_fp32() {
    for family in [Family::Llama, Family::Gemma3] {
        let spec = TinySpec {
            dtype: Dtype::Bfloat16,
            ..TinySpec::tiny(family)
        };
        check_computed_in(spec, Some(1e-3), Some(Dtype::Float32));
    }
    let spec = TinySpec {
        dtype: Dtype::Bfloat16,
        quant_bits: Some(4),
        ..TinySpec::tiny(Family::Qwen3)
    };
    check_computed_in(spec, Some(1e-3), Some(Dtype::Float32));
}

/// `model.compute_dtype: auto` on the CPU with a small packed checkpoint:
/// its 4- and 8-bit weights stay packed and go through the project's
/// kernel (`runtime::packed`), every row count from one decode row to the
/// padded batch and the prefill chunks, and match mlx-lm running the
/// packed weights in fp32: tokens, and logits within 1e-3 (the kernel sums
/// in fp32 in another order than MLX, a few ulps of each product; a
/// wrong group, scale or bit order moves them by whole units).
#[test]
fn packed_weights_through_the_kernel_match_mlx_lm_in_fp32() {
    for bits in [4, 8] {
        let spec = TinySpec {
            quant_bits: Some(bits),
            ..TinySpec::tiny(Family::Qwen3)
        };
        let dir = tempfile::tempdir().unwrap();
        write_model(dir.path(), &spec).unwrap();
        let config = ModelConfig::from_dir(dir.path()).unwrap();
        let weights = Weights::from_dir(dir.path()).unwrap();
        assert!(weights.packed_kernel_takes_all(&config), "{bits} bits");
        assert!(!ComputeDtype::Auto.expands_packed(weights.expanded_bytes(&config), true));
        check(spec, Some(1e-3), Some(Dtype::Float32), None, Packed::Kept);
    }
}

/// `model.compute_dtype: float32` on the CPU with a small packed
/// checkpoint: its 4- and 8-bit weights expanded to fp32 at load match
/// mlx-lm running the packed weights in fp32, tokens and logits.
#[test]
fn packed_weights_expanded_at_load_match_mlx_lm_in_fp32() {
    for bits in [4, 8] {
        let spec = TinySpec {
            quant_bits: Some(bits),
            ..TinySpec::tiny(Family::Qwen3)
        };
        check(
            spec,
            Some(1e-3),
            Some(Dtype::Float32),
            None,
            Packed::Expanded,
        );
    }
}

/// `model.kv_cache`, fp32: keys and values quantized as they are appended
/// and attended through quantized matmul give mlx-lm's tokens, and its
/// logits within 5e-3, for 64 steps, alone and in padded batches, at both
/// bit widths and every group size. Heads of 32 to 128 (groups are at
/// least 32 wide); Gemma 3's sliding layers stay unquantized in both.
/// The tolerance is wider than the unquantized oracles' 1e-3 because a key
/// that lands on a rounding boundary takes the neighbouring code when its
/// projection is summed in another order (OpenBLAS, whose kernels differ
/// by CPU, against the reference's netlib BLAS): that one code moves every
/// later logit, by 4e-4 to 1.1e-2 on these prompts (measured with
/// OpenBLAS's Haswell and SkylakeX kernels). Storing the KV unquantized
/// moves them by 0.15 to 4.3, which `check` shows is outside it.
#[test]
fn quantized_kv_cache_matches_mlx_lm() {
    let kv = |bits, group_size| Some(KvQuant { bits, group_size });
    for (family, head_dim, quant) in [
        (Family::Llama, 32, kv(8, 32)),
        (Family::Qwen3, 64, kv(4, 64)),
        (Family::Qwen3, 128, kv(8, 128)),
        (Family::Gemma3, 32, kv(4, 32)),
    ] {
        let spec = TinySpec {
            head_dim,
            ..TinySpec::tiny(family)
        };
        check(spec, Some(3e-2), None, quant, Packed::Kept);
    }
}

/// Gemma 4 shapes: prompts of up to 30 tokens plus 64 steps cross the
/// 24-token sliding window, and prefill runs in chunks of 7.
mod gemma4 {
    use super::*;
    use fixtures::gemma4::{Gemma4Shape, Layout};

    #[test]
    fn e2b_like_matches_mlx_lm() {
        // Per-layer inputs, KV-shared layers with double-wide MLPs,
        // softcapping; Hugging Face text-only layout.
        check_family(TinySpec::gemma4(Gemma4Shape::e2b(6)), Some(1e-3));
    }

    #[test]
    fn dense_31b_like_matches_mlx_lm() {
        // K=V full-attention layers with their own head size and KV heads;
        // Hugging Face multimodal layout.
        check_family(TinySpec::gemma4(Gemma4Shape::dense_31b(4)), Some(1e-3));
    }

    #[test]
    fn moe_26b_like_matches_mlx_lm_in_both_layouts() {
        for layout in [Layout::Mlx, Layout::HfText] {
            let shape = Gemma4Shape {
                layout,
                ..Gemma4Shape::moe_26b(4)
            };
            check_family(TinySpec::gemma4(shape), Some(1e-3));
        }
    }

    /// Full-attention layers (K=V, their own head size) quantized, sliding
    /// ones not. (mlx-lm cannot run a KV-shared model such as E2B with a
    /// quantized cache: its shared layers hand the quantized tuple to the
    /// unquantized attention.)
    #[test]
    fn dense_31b_like_with_quantized_kv_matches_mlx_lm() {
        let kv = KvQuant {
            bits: 8,
            group_size: 32,
        };
        check(
            TinySpec::gemma4(Gemma4Shape::dense_31b(4)),
            Some(1e-3),
            None,
            Some(kv),
            Packed::Kept,
        );
    }

    #[test]
    fn quantized_moe_matches_mlx_lm() {
        for bits in [4, 8] {
            let spec = TinySpec {
                quant_bits: Some(bits),
                ..TinySpec::gemma4(Gemma4Shape::moe_26b(4))
            };
            check_family(spec, None);
        }
    }

    /// The same experts (and the routers that stay unquantized) expanded
    /// at load, as `auto` does on the CPU.
    #[test]
    fn quantized_moe_expanded_at_load_matches_mlx_lm() {
        let spec = TinySpec {
            quant_bits: Some(4),
            ..TinySpec::gemma4(Gemma4Shape::moe_26b(4))
        };
        check(spec, None, Some(Dtype::Float32), None, Packed::Expanded);
    }

    /// Packed experts, and the layers' dense linears kept expanded beside
    /// their packed weights: prefill chunks and the padded batch of four
    /// multiply by the copies, single decode rows by the packed weights.
    #[test]
    fn quantized_moe_with_dense_copies_matches_mlx_lm() {
        let spec = TinySpec {
            quant_bits: Some(4),
            ..TinySpec::gemma4(Gemma4Shape::moe_26b(4))
        };
        check(
            spec,
            Some(1e-3),
            Some(Dtype::Float32),
            None,
            Packed::WithCopies,
        );
    }
}

/// Qwen3 MoE and Qwen 3.5 (Gated DeltaNet layers between gated attention
/// ones, dense and MoE): prefill in chunks of 7 carries the recurrent
/// state across chunks, and the padded batch's rows (up to 25 columns of
/// left padding) must keep padding out of their states.
mod qwen {
    use super::*;
    use fixtures::qwen::{QwenLayout, QwenShape};

    fn in_layouts(shape: QwenShape) {
        for layout in [QwenLayout::Hf, QwenLayout::Mlx] {
            let spec = TinySpec::qwen(QwenShape {
                layout,
                ..shape.clone()
            });
            check_family(spec, Some(1e-3));
        }
    }

    #[test]
    fn qwen3_moe_matches_mlx_lm_in_both_layouts() {
        in_layouts(QwenShape::qwen3_moe());
    }

    #[test]
    fn qwen35_matches_mlx_lm_in_both_layouts() {
        in_layouts(QwenShape::qwen35());
    }

    #[test]
    fn qwen35_moe_matches_mlx_lm_in_both_layouts() {
        in_layouts(QwenShape::qwen35_moe());
    }

    /// Prompts longer than the delta rule's chunk take its chunked form
    /// (whole, in forwards of 100, and as a batch left-padded by up to
    /// 135 columns, more than two chunks); decoding then loops.
    #[test]
    fn qwen35_long_prompts_prefilled_chunked_match_mlx_lm() {
        for (label, shape) in [
            ("dense", QwenShape::qwen35()),
            ("moe", QwenShape::qwen35_moe()),
        ] {
            let spec = TinySpec::qwen(shape);
            let dir = tempfile::tempdir().unwrap();
            write_model(dir.path(), &spec).unwrap();
            let model = load(dir.path(), None, Packed::Kept);
            let prompts = prompts_of(spec.vocab as u32, &[200, 65, 128, 150]);
            let steps = 16;
            let refs = reference(dir.path(), &prompts, steps, true, None, None);
            let mut worst = 0f32;
            for (i, (prompt, r)) in prompts.iter().zip(&refs).enumerate() {
                for chunk in [prompt.len(), 100] {
                    let (tokens, rows) = ours(&model, prompt, steps, chunk);
                    assert_eq!(
                        tokens, r.tokens,
                        "{label}: prompt {i} (prefill chunk {chunk})"
                    );
                    worst = worst.max(worst_difference(&rows, &r.logits));
                }
            }
            assert!(worst < 1e-3, "{label}: logits differ by {worst}");
            eprintln!("{label}: logits within {worst}");
            let batched = generate::greedy_batch(&model, &prompts, steps, &[]).unwrap();
            for (i, (b, r)) in batched.iter().zip(&refs).enumerate() {
                assert_eq!(b, &r.tokens, "{label}: prompt {i} in a padded batch");
            }
        }
    }

    #[test]
    fn quantized_qwen_matches_mlx_lm() {
        for shape in [
            QwenShape::qwen3_moe(),
            QwenShape::qwen35(),
            QwenShape::qwen35_moe(),
        ] {
            let spec = TinySpec {
                quant_bits: Some(4),
                ..TinySpec::qwen(QwenShape {
                    layout: QwenLayout::Mlx,
                    ..shape
                })
            };
            check_family(spec, None);
        }
    }
}
