//! GGUF's quantized blocks as the loader turns them into MLX affine groups
//! (`engines/runtime/src/gguf/blocks.rs`): random blocks of every type,
//! dequantized from the groups they become, against llama.cpp's own Python
//! dequantization (`gguf.quants`, run by `scripts/ggml_dequantize.py`):
//! equal to fp32 rounding where the conversion is exact, and for Q6_K's
//! groups that have no common grid within the half step its docs state.
//! Then the packed kernel's products over those groups, on every
//! instruction-set path this CPU runs, against an f64 product of the same
//! values.

use fixtures::reference::{logit_rows, worst_difference};
use half::f16;
use mlx_rs::{ops, Array, Dtype};
use runtime::gguf::blocks::{self, Loaded};
use runtime::gguf::{TensorInfo, TensorType};
use runtime::packed::{self, Activations, CpuKernel};

const ROWS: usize = 6;
const COLS: usize = 512;
const GROUP: usize = 32;

/// Deterministic bytes.
fn noise(seed: u64, n: usize) -> Vec<u8> {
    fixtures::model::xorshift(seed)
        .take(n)
        .map(|s| (s >> 32) as u8)
        .collect()
}

fn put(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// `blocks` random blocks of `ty` with sane fp16 fields, `d` about `d`.
/// With `common_grid`, every pair of Q6_K sub-blocks shares a scale (every
/// group converts exactly); without, one super-block in four has equal
/// scales in each pair and one in four a pair's second scale twice the
/// first (groups on a common grid, converted exactly), the rest random
/// pairs.
fn random_blocks(ty: TensorType, blocks: usize, seed: u64, d: f32, common_grid: bool) -> Vec<u8> {
    let (_, size) = ty.block();
    let mut out = noise(seed, blocks * size);
    for (i, b) in out.chunks_exact_mut(size).enumerate() {
        let d = d * (1.0 + 0.35 * (i % 11) as f32);
        match ty {
            TensorType::Q6K => {
                put(b, 208, d);
                for j in 0..8 {
                    let s = b[192 + 2 * j] as i8 / 2;
                    match i % 4 {
                        _ if common_grid => b[193 + 2 * j] = s as u8,
                        0 => b[193 + 2 * j] = s as u8,
                        1 => b[193 + 2 * j] = (2 * s) as u8,
                        _ => {}
                    }
                    b[192 + 2 * j] = s as u8;
                }
            }
            TensorType::Q4K | TensorType::Q5K => {
                // dmin * m about d * s times the mean code: values about 0.
                let mean_code = if ty == TensorType::Q4K { 7.5 } else { 15.5 };
                put(b, 0, d);
                put(b, 2, d * mean_code * (0.8 + 0.1 * (i % 5) as f32));
            }
            TensorType::Q4_1 => {
                put(b, 0, d);
                put(b, 2, -25.0 * d * (i % 3) as f32);
            }
            _ => put(b, 0, d),
        }
    }
    out
}

fn ggml_name(ty: TensorType) -> &'static str {
    match ty {
        TensorType::Q4_0 => "Q4_0",
        TensorType::Q4_1 => "Q4_1",
        TensorType::Q8_0 => "Q8_0",
        TensorType::Q5_0 => "Q5_0",
        TensorType::Q4K => "Q4_K",
        TensorType::Q5K => "Q5_K",
        TensorType::Q6K => "Q6_K",
        other => panic!("{other:?} is not a block type"),
    }
}

/// What gguf-py's `dequantize` makes of each tensor's blocks (type, bytes,
/// rows).
fn ggml_values(tensors: &[(TensorType, &[u8], usize)]) -> Vec<Vec<f32>> {
    let dir = tempfile::tempdir().unwrap();
    let request: Vec<_> = tensors
        .iter()
        .enumerate()
        .map(|(i, (ty, bytes, rows))| {
            let data = dir.path().join(format!("blocks{i}"));
            std::fs::write(&data, bytes).unwrap();
            let out = dir.path().join(format!("values{i}"));
            serde_json::json!({"type": ggml_name(*ty), "data": data, "rows": rows, "out": out})
        })
        .collect();
    let answer = fixtures::reference::run(
        "ggml_dequantize.py",
        &serde_json::json!({ "tensors": request }),
    );
    request
        .iter()
        .zip(answer["values"].as_array().expect("counts"))
        .map(|(r, n)| {
            let values: Vec<f32> = std::fs::read(r["out"].as_str().unwrap())
                .unwrap()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(values.len() as u64, n.as_u64().unwrap());
            values
        })
        .collect()
}

fn kernels() -> Vec<CpuKernel> {
    let runnable = CpuKernel::runnable();
    assert!(
        runnable.contains(&CpuKernel::Scalar),
        "the packed kernel is not built (mlx-sys on Linux builds it)"
    );
    runnable
}

#[test]
fn every_block_type_becomes_mlx_groups_with_ggml_values() {
    let f32_ = Dtype::Float32;
    for (ty, bits, scale_dtype) in [
        (TensorType::Q4_0, 4, Dtype::Float16),
        (TensorType::Q4_1, 4, Dtype::Float16),
        (TensorType::Q8_0, 8, Dtype::Float16),
        (TensorType::Q5_0, 8, Dtype::Float16),
        (TensorType::Q4K, 4, Dtype::Float32),
        (TensorType::Q5K, 8, Dtype::Float32),
        (TensorType::Q6K, 8, Dtype::Float32),
    ] {
        let name = ggml_name(ty);
        let (per_block, size) = ty.block();
        let seed = bits as u64 + size as u64;
        let bytes = random_blocks(ty, ROWS * COLS / per_block, seed, 0.002, false);
        let info = TensorInfo {
            name: "w".into(),
            shape: vec![ROWS, COLS],
            ty,
            start: 0,
            len: bytes.len(),
        };
        let Loaded::Quantized {
            weight,
            scales,
            biases,
            quantization: q,
        } = blocks::load(&info, &bytes)
        else {
            panic!("{name} loads quantized");
        };
        assert_eq!((q.group_size, q.bits), (GROUP as i32, bits), "{name}");
        assert_eq!(scales.dtype(), scale_dtype, "{name}: scales");
        assert_eq!(biases.dtype(), scale_dtype, "{name}: biases");
        let (s, b) = (
            scales.as_dtype(f32_).unwrap(),
            biases.as_dtype(f32_).unwrap(),
        );
        let ours = ops::dequantize(&weight, &s, &b, q.group_size, q.bits).unwrap();
        let ours = ours.as_slice::<f32>().to_vec();
        let want = ggml_values(&[(ty, &bytes, ROWS)]).remove(0);
        let bias = b.as_slice::<f32>();

        let (mut exact_groups, mut rounded_groups) = (0, 0);
        for (g, (got, want)) in ours.chunks(GROUP).zip(want.chunks(GROUP)).enumerate() {
            // `scale * q + bias` rounds once or twice in fp32, as ggml's
            // formulas do: two units in the last place of the larger term.
            let ulps = |w: f32| 2.0 * f32::EPSILON * w.abs().max(bias[g].abs());
            let err = |i: usize| (got[i] - want[i]).abs();
            if (0..GROUP).all(|i| err(i) <= ulps(want[i])) {
                exact_groups += 1;
                continue;
            }
            // Only Q6_K's groups without a common grid may round: to the
            // nearest of 256 steps from the group's least to its greatest.
            assert_eq!(ty, TensorType::Q6K, "{name} group {g}: {got:?} vs {want:?}");
            let lo = want.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = want.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let half_step = (hi - lo) / 510.0;
            for i in 0..GROUP {
                assert!(
                    err(i) <= half_step * (1.0 + 1e-5) + ulps(want[i]),
                    "{name} group {g} element {i}: {} vs {} (half a step {half_step})",
                    got[i],
                    want[i]
                );
            }
            // Q6_K's pairs with a common grid (the first half of every
            // four super-blocks) must not be among them.
            assert!((g / 8) % 4 >= 2, "{name} group {g} should be exact");
            rounded_groups += 1;
        }
        assert!(exact_groups > 0, "{name}: no group is exact");
        if ty == TensorType::Q6K {
            assert!(
                rounded_groups > 0,
                "Q6_K: the rounding branch is not exercised"
            );
        }

        // The kernel over the groups as loaded (fp16 or fp32 scales).
        let n = ROWS;
        for kernel in kernels() {
            for m in [1usize, 3, 17] {
                let xs: Vec<f32> = noise(m as u64 * 31 + bits as u64, m * COLS)
                    .iter()
                    .map(|&v| v as f32 / 128.0 - 1.0)
                    .collect();
                let x = Array::from_slice(&xs, &[m as i32, COLS as i32]);
                let y = packed::matmul_with(
                    Some(kernel),
                    Activations::Float32,
                    &x,
                    &weight,
                    &scales,
                    &biases,
                    q.group_size,
                    q.bits,
                )
                .unwrap();
                y.eval().unwrap();
                let y = y.as_slice::<f32>();
                assert_eq!(y.len(), m * n);
                for r in 0..m {
                    for o in 0..n {
                        let (mut want, mut mag) = (0f64, 0f64);
                        for i in 0..COLS {
                            let t = ours[o * COLS + i] as f64 * xs[r * COLS + i] as f64;
                            want += t;
                            mag += t.abs();
                        }
                        let got = y[r * n + o] as f64;
                        let tol = 1e-5 * mag + 1e-6;
                        assert!(
                            (got - want).abs() <= tol,
                            "{name}, {}, {m} rows: [{r}, {o}] is {got}, the reference {want}",
                            kernel.name()
                        );
                    }
                }
            }
        }
    }
}

/// A generated Gemma 3 whose projections are K-quant and Q5_0 blocks (as a
/// Q4_K_M file mixes them; Q6_K's pairs on a common grid, so every
/// conversion is exact) gives the logits and greedy tokens of the same
/// model with those tensors stored as float32 values that gguf-py's
/// dequantization reads from the blocks: the requantized weights through
/// the packed kernel against dense products of ggml's own values.
#[test]
fn a_k_quant_model_matches_its_ggml_dequantized_weights() {
    use fixtures::gguf::{converted, write_convertible_model, write_gguf};
    use fixtures::model::TinySpec;
    use runtime::{Family, LoadedModel};

    let dir = tempfile::tempdir().unwrap();
    let mut spec = TinySpec::tiny(Family::Gemma3);
    // Every projection's input a multiple of 256 (a K-quant super-block).
    (spec.hidden, spec.intermediate, spec.head_dim) = (256, 512, 64);
    write_convertible_model(dir.path(), &spec);
    let (meta, tensors) = converted(dir.path(), Family::Gemma3);

    // (type, GGUF id, d): values of about 0.05 for each type's codes.
    let types = [
        (TensorType::Q4K, 12, 2e-4),
        (TensorType::Q5K, 13, 1e-4),
        (TensorType::Q6K, 14, 1e-4),
        (TensorType::Q5_0, 6, 6e-3),
    ];
    let projections = [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ];
    let mut quantized = Vec::new();
    let mut picked = Vec::new();
    for (i, (name, ty, shape, data)) in tensors.iter().enumerate() {
        let projection = projections
            .iter()
            .any(|p| name.ends_with(&format!(".{p}.weight")));
        if name == "token_embd.weight" {
            // Through the tied head a token's own embedding outscores any
            // other's by about sqrt(hidden), so at the generator's std 1
            // (times Gemma's sqrt(hidden)) greedy decoding repeats the last
            // token. Small embeddings let the layers decide (they see the
            // input through their RMSNorm at any scale).
            let small = data
                .chunks_exact(4)
                .flat_map(|c| (f32::from_le_bytes(c.try_into().unwrap()) * 0.002).to_le_bytes());
            quantized.push((name.clone(), *ty, shape.clone(), small.collect()));
            continue;
        }
        if !projection {
            quantized.push((name.clone(), *ty, shape.clone(), data.clone()));
            continue;
        }
        let (ty, id, d) = types[picked.len() % types.len()];
        let (per_block, _) = ty.block();
        let blocks = random_blocks(ty, shape[0] * shape[1] / per_block, i as u64, d, true);
        picked.push((quantized.len(), ty, blocks.clone(), shape[0]));
        quantized.push((name.clone(), id, shape.clone(), blocks));
    }
    assert_eq!(picked.len(), 6 * projections.len());
    let requests: Vec<_> = picked
        .iter()
        .map(|(_, ty, blocks, rows)| (*ty, blocks.as_slice(), *rows))
        .collect();
    let mut dense = quantized.clone();
    for ((at, ..), values) in picked.iter().zip(ggml_values(&requests)) {
        dense[*at].1 = 0; // F32
        dense[*at].3 = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    }
    let write = |sub: &str, tensors: &[fixtures::gguf::Tensor]| {
        let out = dir.path().join(sub);
        std::fs::create_dir_all(&out).unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(dir.path().join(f), out.join(f)).unwrap();
        }
        let file = out.join("tiny.gguf");
        std::fs::write(&file, write_gguf(&meta, tensors)).unwrap();
        LoadedModel::load(&file, None).unwrap()
    };
    let (k_quant, reference) = (write("k-quant", &quantized), write("dense", &dense));

    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 500).collect();
    let logits = |m: &LoadedModel| {
        let mut cache = m.model.new_cache(1);
        logit_rows(&runtime::generate::prefill(&m.model, &mut cache, &prompt, 512).unwrap())
    };
    let (a, b) = (logits(&k_quant), logits(&reference));
    let scale = b.iter().flatten().fold(1f32, |m, x| m.max(x.abs()));
    let diff = worst_difference(&a, &b);
    // The same weights: only fp32 summation order differs.
    assert!(
        diff <= 1e-4 * scale,
        "max logit difference {diff} (largest logit {scale})"
    );
    let greedy = |m: &LoadedModel| {
        runtime::generate::greedy(&m.model, &prompt, 32, &[], |_| true)
            .unwrap()
            .tokens
    };
    let tokens = greedy(&reference);
    assert_eq!(tokens.len(), 32);
    assert!(
        tokens
            .iter()
            .collect::<std::collections::HashSet<_>>()
            .len()
            > 1,
        "a degenerate reference: {tokens:?}"
    );
    assert_eq!(greedy(&k_quant), tokens);
}
