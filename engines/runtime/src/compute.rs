//! The dtype the model computes in, chosen for the device.
//!
//! Checkpoints ship bf16 or fp16, which suit GPUs. On the CPU MLX has no
//! half-precision BLAS: every half matmul converts its operands and runs a
//! slower kernel, so a bf16 checkpoint decodes well below the fp32 speed of
//! the same weights. `auto` therefore upcasts half-precision tensors to
//! fp32 at load on the CPU and keeps them elsewhere. Quantized weights'
//! scales and biases take the compute dtype, which sets the dtype of the
//! activations and of the KV cache. On the CPU the packed weights stay
//! packed under `auto` (the project's kernel multiplies them, its scales
//! and biases kept in fp16 where the checkpoint has half precision) and are
//! expanded to fp32 under `float32` where that fits
//! ([`ComputeDtype::expands_packed`]).

use mlx_rs::{Device, DeviceType, Dtype};
use serde::Deserialize;

/// `model.compute_dtype` in config.yaml.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDtype {
    /// fp32 on the CPU, the checkpoint's own dtype on the GPU.
    #[default]
    Auto,
    Float32,
    Bfloat16,
    Float16,
}

impl ComputeDtype {
    /// The name config.yaml gives it.
    pub fn name(self) -> &'static str {
        match self {
            ComputeDtype::Auto => "auto",
            ComputeDtype::Float32 => "float32",
            ComputeDtype::Bfloat16 => "bfloat16",
            ComputeDtype::Float16 => "float16",
        }
    }

    /// The dtype floating-point tensors are cast to at load on the default
    /// device; `None` keeps the checkpoint's.
    pub fn resolve(self) -> Option<Dtype> {
        match self {
            ComputeDtype::Auto => on_cpu().then_some(Dtype::Float32),
            ComputeDtype::Float32 => Some(Dtype::Float32),
            ComputeDtype::Bfloat16 => Some(Dtype::Bfloat16),
            ComputeDtype::Float16 => Some(Dtype::Float16),
        }
    }
}

impl std::str::FromStr for ComputeDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        serde_json::from_value(serde_json::Value::String(s.into()))
            .map_err(|_| format!("unknown compute dtype `{s}` (auto, float32, bfloat16, float16)"))
    }
}

impl ComputeDtype {
    /// Whether packed quantized weights that take `dense_bytes` once
    /// expanded are expanded to fp32 at load: on the CPU, where they take
    /// at most a quarter of the memory, under `float32`, and under `auto`
    /// only where the project's packed kernel ([`crate::packed`]) cannot
    /// take every packed layer (`kernel_takes_all` false: widths other than
    /// 4 and 8 bits, expert stacks), since MLX's own CPU kernel for packed
    /// weights costs a pass over them per row. The packed kernel reads a
    /// quarter (4-bit) of the bytes the fp32 product does and decodes the
    /// default model faster (docs/benchmarks.md, "The packed-weight kernel
    /// against expanded weights"). Larger models keep their memory and stay
    /// packed.
    pub fn expands_packed(self, dense_bytes: u64, kernel_takes_all: bool) -> bool {
        let wanted = match self {
            ComputeDtype::Float32 => true,
            ComputeDtype::Auto => !kernel_takes_all,
            ComputeDtype::Bfloat16 | ComputeDtype::Float16 => false,
        };
        wanted
            && dense_bytes > 0
            && on_cpu()
            && crate::memory::device_total().is_some_and(|total| dense_bytes <= total / 4)
    }

    /// Whether packed layers keep half-precision scales and biases in fp16
    /// ([`crate::weights::Weights::keep_half_scales`]): under `auto` on the
    /// CPU where the project's kernel takes every packed layer (so none is
    /// expanded), as that kernel reads them.
    pub fn keeps_half_scales(self, kernel_takes_all: bool) -> bool {
        self == ComputeDtype::Auto && kernel_takes_all && on_cpu()
    }

    /// Whether, under `auto` on a GPU, the packed linears of the decoder
    /// layers also keep a copy expanded to the compute dtype, for products
    /// of several rows (batched steps, verifies, prefill): MLX CUDA's 4-bit
    /// kernels take 1.2-4.6x cuBLAS's time on the expanded weights for
    /// 4-32 rows, while one row reads the packed weights faster
    /// (docs/gpu.md, "Gemma 4 and other MoE shapes"). Only where the copies
    /// (`copy_bytes`) take at most a quarter of the checkpoint's
    /// (`checkpoint_bytes`): mixture-of-experts checkpoints, whose experts
    /// stay packed and hold most of the weights. A dense quantized model
    /// keeps its memory.
    pub fn keeps_dense_copies(self, copy_bytes: u64, checkpoint_bytes: u64) -> bool {
        self == ComputeDtype::Auto
            && copy_bytes > 0
            && copy_bytes * 4 <= checkpoint_bytes
            && !on_cpu()
    }
}

/// Whether MLX computes on the CPU by default (no GPU backend, or none
/// present).
pub fn on_cpu() -> bool {
    !matches!(Device::default().get_type(), Ok(DeviceType::Gpu))
}

/// Whether a checkpoint tensor of dtype `from` takes the compute dtype:
/// floating-point tensors do; packed quantized weights and integer tensors
/// keep theirs.
pub fn casts(from: Dtype) -> bool {
    matches!(from, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_fixed_choices_resolve() {
        assert_eq!("auto".parse::<ComputeDtype>(), Ok(ComputeDtype::Auto));
        assert_eq!(
            "bfloat16".parse::<ComputeDtype>().unwrap().resolve(),
            Some(Dtype::Bfloat16)
        );
        assert_eq!(ComputeDtype::Float32.resolve(), Some(Dtype::Float32));
        assert!("fp8"
            .parse::<ComputeDtype>()
            .unwrap_err()
            .contains("float32"));
        assert!(!casts(Dtype::Uint32));
    }
}
