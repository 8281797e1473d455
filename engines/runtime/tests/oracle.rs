//! Greedy tokens and logits against the reference implementation, Python
//! mlx-lm, on the same generated weights (installed by scripts/setup into
//! .mlx/venv). Every family, fp32, bf16 and 4/8-bit quantized, single
//! sequences and a left-padded batch of mixed prompt lengths.

use std::path::Path;

use fixtures::model::{write_model, TinySpec};
use mlx_rs::Dtype;
use runtime::config::ModelConfig;
use runtime::generate::{self, prefill};
use runtime::mask::{set_row_attention, RowAttention};
use runtime::model::{Logits, Model};
use runtime::weights::Weights;
use runtime::Family;

const STEPS: usize = 64;

struct Reference {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

/// mlx-lm's greedy run; `cast` casts its floating-point parameters first.
fn reference(
    dir: &Path,
    prompts: &[Vec<u32>],
    steps: usize,
    logits: bool,
    cast: Option<&str>,
) -> Vec<Reference> {
    let req = serde_json::json!({ "model": dir, "prompts": prompts, "max_tokens": steps, "logits": logits, "dtype": cast });
    let v = fixtures::reference::run("mlx_lm_oracle.py", &req);
    v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| Reference {
            tokens: r["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect(),
            logits: r["logits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|row| {
                    row.as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_f64().unwrap() as f32)
                        .collect()
                })
                .collect(),
        })
        .collect()
}

/// The model, its floating-point weights cast to `compute` (as
/// `model.compute_dtype` does at load).
fn load(dir: &Path, compute: Option<Dtype>) -> Model {
    let mut weights = Weights::from_dir(dir).unwrap();
    if let Some(dtype) = compute {
        weights.cast_floats(dtype).unwrap();
    }
    Model::load(ModelConfig::from_dir(dir).unwrap(), weights).unwrap()
}

/// Our greedy decode, step by step, keeping every step's logits.
fn ours(model: &Model, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut cache = model.new_cache(1);
    let mut logits = prefill(model, &mut cache, prompt, 7).unwrap();
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
    // Deterministic pseudo-random ids; lengths straddle the Gemma window (24)
    // and the prefill chunk (7) used above.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    [5usize, 17, 30, 9]
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

/// Ours with the checkpoint's floats cast to `compute` against mlx-lm with
/// its parameters cast the same way.
fn check_computed_in(spec: TinySpec, logit_tol: Option<f32>, compute: Option<Dtype>) {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &spec).unwrap();
    let model = load(dir.path(), compute);
    let prompts = prompts(spec.vocab as u32);
    let cast = compute.map(|d| match d {
        Dtype::Float32 => "float32",
        Dtype::Bfloat16 => "bfloat16",
        Dtype::Float16 => "float16",
        other => unreachable!("not a compute dtype: {other:?}"),
    });
    let refs = reference(dir.path(), &prompts, STEPS, logit_tol.is_some(), cast);
    let label = format!(
        "{:?} {:?} q{:?} computed in {:?}",
        spec.family, spec.dtype, spec.quant_bits, compute
    );
    for (i, (prompt, r)) in prompts.iter().zip(&refs).enumerate() {
        let (tokens, rows) = ours(&model, prompt, STEPS);
        assert_eq!(
            tokens, r.tokens,
            "{label}: prompt {i} greedy tokens differ from mlx-lm"
        );
        if let Some(tol) = logit_tol {
            let worst = rows
                .iter()
                .zip(&r.logits)
                .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
                .fold(0f32, f32::max);
            assert!(
                worst < tol,
                "{label}: prompt {i} logits differ by {worst} (tolerance {tol})"
            );
        }
        // The production loop (pipelined, chunked prefill) gives the same.
        let run = generate::greedy(&model, prompt, STEPS, &[], |_| true).unwrap();
        assert_eq!(
            run.tokens, r.tokens,
            "{label}: prompt {i} generate::greedy differs"
        );
    }
    // Both ways a padded batch can decode: one masked attention, or one
    // unmasked attention per row (what GPUs use).
    for mode in [RowAttention::Never, RowAttention::Always] {
        set_row_attention(mode);
        let batched = generate::greedy_batch(&model, &prompts, STEPS, &[]).unwrap();
        set_row_attention(RowAttention::Auto);
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
