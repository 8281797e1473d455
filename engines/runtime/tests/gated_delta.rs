//! The gated delta rule's chunked form (prefill) against its per-position
//! loop (decode, and what mlx-lm runs off Metal) on random float32 inputs:
//! lengths below, at and above multiples of the chunk, an initial state,
//! left padding, repeated keys, and decays that underflow within a chunk.

use std::time::Instant;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{fast, ops, random, Array};
use runtime::model::gated_delta::{delta_rule_chunked, delta_rule_steps, DeltaInputs, CHUNK};

const TOLERANCE: f32 = 1e-4;

struct Shape {
    b: i32,
    s: i32,
    h: i32,
    dk: i32,
    dv: i32,
}

fn normal(shape: &[i32], seed: u64) -> Array {
    random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap()
}

fn uniform(lo: f32, hi: f32, shape: &[i32], seed: u64) -> Array {
    random::uniform::<_, f32>(lo, hi, shape, &random::key(seed).unwrap()).unwrap()
}

/// Unit-norm keys, queries scaled by `dk^-1/2` (as the layer makes them),
/// decays `exp(log_decay)` with `log_decay` in `[-decay_span, 0)`.
fn inputs(x: &Shape, seed: u64, decay_span: f32) -> DeltaInputs {
    let unit = |a: Array| {
        fast::rms_norm(&a, None, 1e-6)
            .unwrap()
            .multiply(Array::from_f32((x.dk as f32).powf(-0.5)))
            .unwrap()
    };
    let qk = [x.b, x.s, x.h, x.dk];
    DeltaInputs {
        q: unit(normal(&qk, seed))
            .multiply(Array::from_f32((x.dk as f32).powf(-0.5)))
            .unwrap(),
        k: unit(normal(&qk, seed + 1)),
        v: normal(&[x.b, x.s, x.h, x.dv], seed + 2),
        log_decay: uniform(-decay_span, 0.0, &[x.b, x.s, x.h], seed + 3),
        beta: uniform(0.0, 1.0, &[x.b, x.s, x.h], seed + 4),
    }
}

fn initial_state(x: &Shape, seed: u64) -> Array {
    normal(&[x.b, x.h, x.dv, x.dk], seed)
        .multiply(Array::from_f32(0.5))
        .unwrap()
}

/// `max |a - b| / max |b|`.
fn relative(a: &Array, b: &Array) -> f32 {
    let diff = a.subtract(b).unwrap().abs().unwrap().max(None).unwrap();
    let scale = b.abs().unwrap().max(None).unwrap();
    diff.item_exact::<f32>() / scale.item_exact::<f32>().max(f32::MIN_POSITIVE)
}

/// Both forms from `state`; panics past the tolerance, returns the worst
/// relative difference of outputs and final states.
fn compare(label: &str, x: &DeltaInputs, state: &Array) -> f32 {
    let (y_loop, s_loop, _) = delta_rule_steps(x, state, false).unwrap();
    let (y_chunk, s_chunk) = delta_rule_chunked(x, state).unwrap();
    assert_eq!(y_chunk.shape(), y_loop.shape(), "{label}");
    assert_eq!(s_chunk.shape(), s_loop.shape(), "{label}");
    let (dy, ds) = (relative(&y_chunk, &y_loop), relative(&s_chunk, &s_loop));
    eprintln!("{label}: outputs within {dy:.2e}, state within {ds:.2e} (relative)");
    assert!(dy < TOLERANCE, "{label}: outputs differ by {dy} (relative)");
    assert!(ds < TOLERANCE, "{label}: states differ by {ds} (relative)");
    dy.max(ds)
}

#[test]
fn chunked_equals_the_loop_around_chunk_multiples() {
    let mut worst = 0f32;
    for s in [
        2,
        9,
        CHUNK - 1,
        CHUNK,
        CHUNK + 1,
        2 * CHUNK - 1,
        2 * CHUNK,
        2 * CHUNK + 1,
        3 * CHUNK + 17,
    ] {
        for (with_state, seed) in [(false, 10), (true, 20)] {
            let x = Shape {
                b: 2,
                s,
                h: 4,
                dk: 32,
                dv: 16,
            };
            let state = if with_state {
                initial_state(&x, seed + 9)
            } else {
                ops::zeros::<f32>(&[x.b, x.h, x.dv, x.dk]).unwrap()
            };
            let label = format!("s {s}, initial state {with_state}");
            worst = worst.max(compare(&label, &inputs(&x, seed, 1.0), &state));
        }
    }
    // The real head size (128) across two chunks and a partial one.
    let x = Shape {
        b: 1,
        s: 2 * CHUNK + 2,
        h: 4,
        dk: 128,
        dv: 128,
    };
    let real = compare("heads of 128", &inputs(&x, 30, 1.0), &initial_state(&x, 39));
    eprintln!("worst relative difference {:.2e}", worst.max(real));
}

#[test]
fn left_padding_leaves_the_state_exactly_unchanged() {
    let x = Shape {
        b: 3,
        s: 2 * CHUNK + 5,
        h: 4,
        dk: 32,
        dv: 16,
    };
    let state = initial_state(&x, 31);
    // Row 0 unpadded, row 1 padded past a whole chunk, row 2 all padding.
    let pads = [0, CHUNK + 3, x.s];
    let real: Vec<bool> = pads
        .iter()
        .flat_map(|&p| (0..x.s).map(move |t| t >= p))
        .collect();
    let mask = Array::from_slice(&real, &[x.b, x.s]);
    let masked = inputs(&x, 40, 1.0).masked(&mask).unwrap();
    compare("left padded", &masked, &state);
    let (_, after) = delta_rule_chunked(&masked, &state).unwrap();
    let (_, after_loop, _) = delta_rule_steps(&masked, &state, false).unwrap();
    let row = |a: &Array, r: i32| a.index(r).as_slice::<f32>().to_vec();
    assert_eq!(
        row(&after, 2),
        row(&state, 2),
        "chunked: an all-padding row's state changed"
    );
    assert_eq!(
        row(&after_loop, 2),
        row(&state, 2),
        "loop: an all-padding row's state changed"
    );
    // A padded row equals the same row's real positions run alone.
    let p = pads[1];
    let alone = Shape {
        b: 1,
        s: x.s - p,
        ..x
    };
    let tail = |a: &Array| {
        let a = a.index(1).expand_dims(0).unwrap();
        let shape = a.shape().to_vec();
        let mut start = vec![0; shape.len()];
        start[1] = p;
        runtime::slices::slice(&a, &start, &shape).unwrap()
    };
    let unpadded = DeltaInputs {
        q: tail(&masked.q),
        k: tail(&masked.k),
        v: tail(&masked.v),
        log_decay: tail(&masked.log_decay),
        beta: tail(&masked.beta),
    };
    let row_state = state.index(1).expand_dims(0).unwrap();
    let (y_alone, s_alone) = delta_rule_chunked(&unpadded, &row_state).unwrap();
    let (y_padded, s_padded) = delta_rule_chunked(&masked, &state).unwrap();
    let dy = relative(&tail(&y_padded), &y_alone);
    let ds = relative(&s_padded.index(1).expand_dims(0).unwrap(), &s_alone);
    eprintln!(
        "padded row ({} of {} positions) vs alone: {dy:.2e}, {ds:.2e}",
        alone.s, x.s
    );
    assert!(dy < TOLERANCE && ds < TOLERANCE, "{dy} {ds}");
}

#[test]
fn repeated_keys_and_vanishing_decays_stay_accurate() {
    let x = Shape {
        b: 1,
        s: 3 * CHUNK,
        h: 2,
        dk: 32,
        dv: 16,
    };
    // One key for every position and beta near 1: (I + A) is all ones
    // below the diagonal, the case that makes a power series blow up.
    let same = inputs(&x, 50, 0.0);
    let one_key = runtime::slices::slice(&same.k, &[0, 0, 0, 0], &[1, 1, x.h, x.dk]).unwrap();
    let repeated = DeltaInputs {
        k: ops::broadcast_to(&one_key, &[1, x.s, x.h, x.dk]).unwrap(),
        beta: uniform(0.9, 1.0, &[1, x.s, x.h], 56),
        log_decay: ops::zeros::<f32>(&[1, x.s, x.h]).unwrap(),
        ..same
    };
    compare("repeated keys, no decay", &repeated, &initial_state(&x, 57));
    // Decays down to exp(-60) per position: cumulative products underflow
    // float32 within a chunk.
    compare(
        "vanishing decays",
        &inputs(&x, 60, 60.0),
        &initial_state(&x, 61),
    );
}

/// Loop and chunked form at the bench preset's linear geometry (4 value
/// heads of 16) and Qwen3.5-4B's (32 of 128):
/// `cargo test -p runtime --test gated_delta -- --ignored --nocapture`
/// (test binaries load MLX's bundled reference BLAS; preload OpenBLAS, as
/// the gateway links it, for its numbers).
#[test]
#[ignore]
fn timing() {
    for (h, d, s) in [2, 4, 8, 16, 64, 512]
        .map(|s| (4, 16, s))
        .into_iter()
        .chain([2, 4, 8, 16, 32, 64, 128, 512].map(|s| (32, 128, s)))
    {
        let x = Shape {
            b: 1,
            s,
            h,
            dk: d,
            dv: d,
        };
        let inp = inputs(&x, 70, 1.0);
        let state = initial_state(&x, 71);
        mlx_rs::transforms::eval([&inp.q, &inp.k, &inp.v, &inp.log_decay, &inp.beta, &state])
            .unwrap();
        let time = |f: &dyn Fn() -> (Array, Array)| {
            let mut best = f64::MAX;
            for _ in 0..3 {
                let start = Instant::now();
                let (y, st) = f();
                mlx_rs::transforms::eval([&y, &st]).unwrap();
                best = best.min(start.elapsed().as_secs_f64());
            }
            best * 1e3
        };
        let looped = time(&|| {
            let (y, st, _) = delta_rule_steps(&inp, &state, false).unwrap();
            (y, st)
        });
        let chunked = time(&|| delta_rule_chunked(&inp, &state).unwrap());
        eprintln!("{h} heads of {d}, s {s}: loop {looped:.2} ms, chunked {chunked:.2} ms");
    }
}
