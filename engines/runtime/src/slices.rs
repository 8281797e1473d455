//! Strided views and in-place slice writes over every axis, through mlx-c
//! (mlx-rs does not wrap them with the signatures the KV storage needs).

use anyhow::anyhow;
use mlx_rs::Array;

/// A strided view `a[start:stop]` over every axis (no copy).
pub fn slice(a: &Array, start: &[i32], stop: &[i32]) -> anyhow::Result<Array> {
    let strides = vec![1; start.len()];
    ffi_op(|res, stream| unsafe {
        mlx_sys::mlx_slice(
            res,
            a.as_ptr(),
            start.as_ptr(),
            start.len(),
            stop.as_ptr(),
            stop.len(),
            strides.as_ptr(),
            strides.len(),
            stream,
        )
    })
}

/// `buf` with `update` written at `start` (`buf` is taken so MLX can write
/// it in place).
pub fn slice_update(buf: Array, update: &Array, start: &[i32]) -> anyhow::Result<Array> {
    let stop: Vec<i32> = start
        .iter()
        .zip(update.shape())
        .map(|(a, n)| a + n)
        .collect();
    let strides = vec![1; start.len()];
    let n = start.len();
    ffi_op(|res, stream| unsafe {
        mlx_sys::mlx_slice_update(
            res,
            buf.as_ptr(),
            update.as_ptr(),
            start.as_ptr(),
            n,
            stop.as_ptr(),
            n,
            strides.as_ptr(),
            n,
            stream,
        )
    })
}

/// `buf[:, :, from:to, :]`: columns of a `[B, heads, columns, _]` buffer.
pub(crate) fn slice_cols(buf: &Array, from: i32, to: i32) -> anyhow::Result<Array> {
    let s = buf.shape();
    slice(buf, &[0, 0, from, 0], &[s[0], s[1], to, s[3]])
}

/// Runs one mlx-c op that mlx-rs does not wrap with the signature we need.
fn ffi_op(
    f: impl FnOnce(*mut mlx_sys::mlx_array, mlx_sys::mlx_stream) -> i32,
) -> anyhow::Result<Array> {
    let stream = mlx_rs::Stream::thread_local_or_default();
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        if f(&mut res, stream.as_ptr()) != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(anyhow!("mlx slice operation failed"));
        }
        Ok(Array::from_ptr(res))
    }
}
