//! Products with packed weights (MLX affine 4- and 8-bit) on the CPU,
//! through the project's own kernel (`mlx-sys/native/packed_matmul.cpp`): a
//! node of the MLX graph that reads each packed weight row once per call
//! for every row of the input, on every core, with AVX2 or AVX-512 where the
//! CPU has them, and from 16 rows on (AVX-512) tiles of rows and columns
//! over the weights dequantized once per call into a panel per thread.
//! MLX's own CPU `quantized_matmul` costs a pass over the weights per row,
//! on one thread.

use mlx_rs::error::Exception;
use mlx_rs::Array;

/// The instruction-set paths of the kernel, slowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CpuKernel {
    Scalar = 0,
    Avx2 = 1,
    Avx512 = 2,
}

impl CpuKernel {
    const ALL: [CpuKernel; 3] = [CpuKernel::Scalar, CpuKernel::Avx2, CpuKernel::Avx512];

    fn from_code(code: i32) -> CpuKernel {
        Self::ALL[code.clamp(0, 2) as usize]
    }

    /// The setting's name (`GATEWAY_CPU_KERNEL`).
    pub fn name(self) -> &'static str {
        match self {
            CpuKernel::Scalar => "scalar",
            CpuKernel::Avx2 => "avx2",
            CpuKernel::Avx512 => "avx512",
        }
    }

    /// Every path this CPU runs; empty where the kernel is not built.
    pub fn runnable() -> Vec<CpuKernel> {
        match mlx_sys::packed_kernels() {
            Some((best, _)) => Self::ALL
                .into_iter()
                .filter(|k| *k as i32 <= best)
                .collect(),
            None => Vec::new(),
        }
    }

    /// The path products take: the best this CPU runs, capped by
    /// `GATEWAY_CPU_KERNEL` (`scalar`, `avx2`, `avx512`).
    pub fn chosen() -> Option<CpuKernel> {
        mlx_sys::packed_kernels().map(|(_, chosen)| Self::from_code(chosen))
    }
}

/// How the kernel reads the activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    /// As fp32: each weight is `scale * q + bias` in fp32, as MLX's
    /// `dequantize` makes it, so products match MLX's to fp32 rounding.
    Float32,
    /// Rounded to int8 per block of 32 (`d = max|x| / 127`), integer dot
    /// products with the packed weights (AVX-512 VNNI `vpdpbusd`, AVX2
    /// `vpmaddubsw`), the bias term from the exact fp32 sums: each product
    /// is off by at most `sum |scale * q| * d / 2` over its inputs.
    Int8,
}

impl Activations {
    fn bits(self) -> i32 {
        match self {
            Activations::Float32 => 32,
            Activations::Int8 => 8,
        }
    }

    /// The setting's name (`GATEWAY_CPU_ACTIVATIONS`).
    pub fn name(self) -> &'static str {
        match self {
            Activations::Float32 => "float32",
            Activations::Int8 => "int8",
        }
    }

    /// What [`matmul`] uses: `GATEWAY_CPU_ACTIVATIONS` (`float32`, `int8`),
    /// read once; [`Activations::Float32`] when unset.
    pub fn chosen() -> Activations {
        static CHOSEN: std::sync::OnceLock<Activations> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(
            || match std::env::var("GATEWAY_CPU_ACTIVATIONS").as_deref() {
                Ok("int8") => Activations::Int8,
                _ => Activations::Float32,
            },
        )
    }
}

/// Whether the chosen path multiplies many rows (a prefill chunk) at
/// compute speed: AVX-512 with fp32 activations, whose span for many rows
/// (`span_avx512_lanes` in the kernel) beats dequantizing and BLAS's
/// `sgemm` (`examples/packed_rows.rs`). The AVX2, scalar and int8 paths
/// re-read the activations per output column, which is slower than BLAS
/// from about a hundred rows.
pub fn many_rows_fast() -> bool {
    CpuKernel::chosen() == Some(CpuKernel::Avx512) && Activations::chosen() == Activations::Float32
}

/// Whether the kernel takes weights of `bits` in groups of `group_size`.
pub fn supports(bits: i32, group_size: i32) -> bool {
    mlx_sys::packed_kernels().is_some()
        && matches!(bits, 4 | 8)
        && matches!(group_size, 32 | 64 | 128)
}

/// `x @ dequantize(w, scales, biases)^T`, like MLX's
/// `quantized_matmul(.., transpose = true, ..)`, with the chosen path and
/// activations ([`Activations::chosen`]).
pub fn matmul(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
) -> Result<Array, Exception> {
    matmul_with(
        None,
        Activations::chosen(),
        x,
        w,
        scales,
        biases,
        group_size,
        bits,
    )
}

/// [`matmul`] with the path (`None`: the chosen one) and activations named.
#[allow(clippy::too_many_arguments)]
pub fn matmul_with(
    kernel: Option<CpuKernel>,
    activations: Activations,
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
) -> Result<Array, Exception> {
    crate::cpu_fused::native_node("packed matmul", |res, stream| unsafe {
        mlx_sys::packed_matmul(
            res,
            x.as_ptr(),
            w.as_ptr(),
            scales.as_ptr(),
            biases.as_ptr(),
            group_size,
            bits,
            kernel.map_or(-1, |k| k as i32),
            activations.bits(),
            stream,
        )
    })
}
