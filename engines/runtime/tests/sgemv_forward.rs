//! MLX's float32 products with one row or one column go to a small gemv of
//! our own or to OpenBLAS's sgemv (`mlx-sys/native/sgemv_forward.c`), every
//! other product to sgemm: each
//! layout MLX can hand over gives the product a BLAS-free reference gives.

use mlx_rs::{ops, Array};

/// `a @ b` by broadcasting and summing: no BLAS call.
fn reference(a: &Array, b: &Array) -> Array {
    let a = a.expand_dims(-1).unwrap(); // [m, k, 1]
    let b = b.expand_dims(0).unwrap(); // [1, k, n]
    a.multiply(&b).unwrap().sum_axis(1, None).unwrap()
}

fn values(shape: &[i32], seed: f32) -> Array {
    let n: i32 = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|i| (i as f32 * 0.37 + seed).sin() * 0.5)
        .collect();
    Array::from_slice(&data, shape)
}

fn assert_close(got: &Array, want: &Array, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let diff = got
        .subtract(want)
        .unwrap()
        .abs()
        .unwrap()
        .max(None)
        .unwrap()
        .item_exact::<f32>();
    assert!(diff < 1e-4, "{what}: max |difference| {diff}");
}

#[test]
fn one_row_and_one_column_products_go_to_sgemv_and_equal_the_reference() {
    // `scripts/setup` installs OpenBLAS; a build without it has no forwarding.
    let before = mlx_sys::sgemv_forwarded().expect("mlx-sys was built without OpenBLAS");
    let (k, n) = (96, 40);
    let w = values(&[n, k], 1.0); // a weight as Linear stores it: [out, in]
    let x = values(&[1, k], 2.0);
    let cases: Vec<(&str, Array, Array)> = vec![
        ("row times transposed weight", x.clone(), w.t()),
        (
            "row times contiguous matrix",
            x.clone(),
            values(&[k, n], 3.0),
        ),
        ("matrix times column", w.clone(), x.t()),
        (
            "transposed matrix times column",
            values(&[k, n], 4.0).t(),
            values(&[k, 1], 5.0),
        ),
    ];
    for (what, a, b) in &cases {
        let got = ops::matmul(a, b).unwrap();
        got.eval().unwrap();
        assert_close(&got, &reference(a, b), what);
    }
    let forwarded = mlx_sys::sgemv_forwarded().unwrap() - before;
    assert_eq!(forwarded, cases.len() as u64, "products sent to sgemv");

    // Past 65,536 elements the product is OpenBLAS's sgemv (smaller ones,
    // above, run on the calling thread).
    let (big_k, big_n) = (128, 640);
    let big = values(&[big_n, big_k], 7.0);
    let row = values(&[1, big_k], 8.0);
    let got = ops::matmul(&row, big.t()).unwrap();
    got.eval().unwrap();
    assert_close(
        &got,
        &reference(&row, &big.t()),
        "large row times transposed weight",
    );
    let forwarded = forwarded + 1;
    assert_eq!(mlx_sys::sgemv_forwarded().unwrap() - before, forwarded);

    // Three rows stay a matrix product, with the same result as before.
    let rows = values(&[3, k], 6.0);
    let got = ops::matmul(&rows, &w.t()).unwrap();
    got.eval().unwrap();
    assert_close(&got, &reference(&rows, &w.t()), "three rows");
    assert_eq!(mlx_sys::sgemv_forwarded().unwrap() - before, forwarded);
}
