//! Raw mlx-c bindings (see build.rs for how mlx-c and libmlx are found).
#![allow(non_upper_case_globals)]
#![allow(non_camel_case_types)]
#![allow(non_snake_case)]
#![allow(clippy::all)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

#[cfg(mlx_openblas)]
extern "C" {
    fn openblas_get_config() -> *const std::os::raw::c_char;
    fn openblas_get_num_threads() -> std::os::raw::c_int;
    fn mlx_sys_sgemv_forwarded() -> std::os::raw::c_ulong;
}

/// How many of MLX's float32 products this process sent to OpenBLAS's
/// `sgemv` instead of `sgemm` (one row or one column; see
/// `native/sgemv_forward.c`). `None` where MLX uses the wheel's own BLAS.
pub fn sgemv_forwarded() -> Option<u64> {
    #[cfg(mlx_openblas)]
    return Some(unsafe { mlx_sys_sgemv_forwarded() } as u64);
    #[cfg(not(mlx_openblas))]
    None
}

/// Names the BLAS serving MLX's CPU matmuls. Calling it also makes OpenBLAS a
/// direct dependency of the binary (see build.rs), which is what puts it
/// ahead of the wheel's bundled reference BLAS.
pub fn blas_backend() -> String {
    #[cfg(mlx_openblas)]
    unsafe {
        let config = std::ffi::CStr::from_ptr(openblas_get_config()).to_string_lossy();
        format!(
            "{} ({} threads; one-row products through sgemv, {} so far)",
            config.trim(),
            openblas_get_num_threads(),
            mlx_sys_sgemv_forwarded()
        )
    }
    #[cfg(not(mlx_openblas))]
    {
        String::from("bundled with libmlx")
    }
}
