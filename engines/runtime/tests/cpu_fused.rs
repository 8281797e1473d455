//! The CPU's one-node RoPE and RMSNorm (`mlx-sys/native/cpu_fused.cpp`)
//! against MLX's own `fast::rope` / `fast::rms_norm`, which on the CPU run
//! as their composed fallbacks: every shape the models use (partial
//! rotary dims, one offset or one per row, custom frequencies, a position
//! scale, strided views as the stacked projections hand over).

use mlx_rs::{fast, ops, random, Array};
use runtime::cpu_fused;

fn close(got: &Array, want: &Array, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}");
    let diff = ops::abs(&got.subtract(want).unwrap())
        .unwrap()
        .max(None)
        .unwrap();
    let scale = ops::abs(want).unwrap().max(None).unwrap();
    let (diff, scale) = (diff.item::<f32>(), scale.item::<f32>());
    // The same float32 angles (the inverse frequencies come from MLX's own
    // ops), cos and sin from two libraries, sums in another order: a few
    // units in the last place of the largest value.
    assert!(
        diff <= 4.0 * f32::EPSILON * scale.max(1.0),
        "{what}: max |diff| {diff} (scale {scale})"
    );
}

fn normal(shape: &[i32], seed: u64) -> Array {
    random::seed(seed).unwrap();
    random::normal::<f32>(shape, None, None, None).unwrap()
}

#[test]
fn the_fused_nodes_run_here() {
    // The CI machine is a CPU: the nodes must be the ones under test.
    assert!(
        cpu_fused::enabled(),
        "the CPU nodes are not built or not enabled"
    );
}

#[test]
fn rope_matches_mlx() {
    let freqs: Vec<f32> = (0..16)
        .map(|i| 10000f32.powf(i as f32 / 16.0) * 1.5)
        .collect();
    let freqs = Array::from_slice(&freqs, &[16]);
    for (b, n, t, d, dims) in [
        (1, 9, 1, 64, 64),
        (3, 4, 7, 64, 64),
        (2, 2, 33, 128, 64),
        (1, 3, 5, 48, 32),
    ] {
        let x = normal(&[b, n, t, d], (b * n * t * d) as u64);
        let offsets = [
            Array::from_int(0),
            Array::from_int(977),
            Array::from_slice(&(0..b).map(|r| 13 * r + 100).collect::<Vec<_>>(), &[b]),
        ];
        for offset in &offsets {
            for (base, scale, freqs) in [
                (Some(10000f32), 1.0f32, None),
                (Some(500000.0), 0.25, None),
                (None, 1.0, Some(&freqs)),
            ] {
                if freqs.is_some() && dims != 32 {
                    continue;
                }
                assert!(cpu_fused::takes_rope(&x));
                let want = fast::rope_dynamic(&x, dims, false, base, scale, offset, freqs).unwrap();
                let inv = cpu_fused::inverse_frequencies(dims, base, freqs).unwrap();
                let got = cpu_fused::rope(&x, dims, scale, offset, &inv).unwrap();
                close(&got, &want, &format!("rope {b}x{n}x{t}x{d} dims {dims} offset {offset:?} base {base:?} scale {scale}"));
            }
        }
        // A strided view: [B, T, N, D] transposed to [B, N, T, D], as the
        // projections' output is split into heads.
        let bt = normal(&[b, t, n, d], 7)
            .transpose_axes(&[0, 2, 1, 3])
            .unwrap();
        let want =
            fast::rope_dynamic(&bt, dims, false, Some(10000.0), 1.0, &offsets[1], None).unwrap();
        let inv = cpu_fused::inverse_frequencies(dims, Some(10000.0), None).unwrap();
        let got = cpu_fused::rope(&bt, dims, 1.0, &offsets[1], &inv).unwrap();
        close(&got, &want, "rope of a transposed view");
    }
}

#[test]
fn rms_norm_matches_mlx() {
    for shape in [
        vec![1, 1, 576],
        vec![3, 5, 576],
        vec![2, 7, 9, 64],
        vec![4, 33],
    ] {
        let x = normal(&shape, shape.iter().product::<i32>() as u64);
        let d = *shape.last().unwrap();
        let w = normal(&[d], 3);
        for weight in [Some(&w), None] {
            let want = fast::rms_norm(&x, weight, 1e-5).unwrap();
            let got = cpu_fused::rms_norm(&x, weight, 1e-5).unwrap();
            close(
                &got,
                &want,
                &format!("rms_norm {shape:?} weight {}", weight.is_some()),
            );
        }
    }
    // A strided view (the last axis not the fastest).
    let x = normal(&[64, 6], 11).transpose_axes(&[1, 0]).unwrap();
    let w = normal(&[64], 12);
    let want = fast::rms_norm(&x, Some(&w), 1e-6).unwrap();
    close(
        &cpu_fused::rms_norm(&x, Some(&w), 1e-6).unwrap(),
        &want,
        "rms_norm of a transposed view",
    );
}

#[test]
fn other_dtypes_keep_mlx_ops() {
    let x = normal(&[1, 2, 3, 64], 5)
        .as_dtype(mlx_rs::Dtype::Bfloat16)
        .unwrap();
    assert!(!cpu_fused::takes_rope(&x));
    let w = Array::ones::<f32>(&[64])
        .unwrap()
        .as_dtype(mlx_rs::Dtype::Bfloat16)
        .unwrap();
    let got = cpu_fused::rms_norm(&x, Some(&w), 1e-5).unwrap();
    assert_eq!(got.dtype(), mlx_rs::Dtype::Bfloat16);
}
