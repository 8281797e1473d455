//! The MLX model runtime: loads a Hugging Face model directory once, runs the
//! forward pass with a KV cache (single sequences and padded batches), and
//! samples on the device. Engines build on it; the gateway shares one
//! [`LoadedModel`] between all of them.

pub mod abi;
pub mod activations;
pub mod admission;
pub mod cache;
pub mod compute;
pub mod config;
pub mod cpu_fused;
pub mod cuda_env;
pub mod cuda_kernel;
pub mod device;
pub mod emit;
pub mod generate;
pub mod generation_config;
pub mod gguf;
pub mod gpu_fused;
pub mod handover;
pub mod inject;
pub mod kv_pool;
pub mod kv_quant;
pub mod memory;
pub mod prefix_cache;
pub mod sampling;
pub mod sequence;
pub mod shared;
pub mod slices;
pub mod vision;

pub mod layers;
pub mod loader;

pub mod mask;
pub mod model;
pub mod packed;
pub mod paged;
pub mod ragged;

pub mod weights;
pub mod worker;

pub use cache::KvCache;
pub use compute::ComputeDtype;
pub use config::{Family, ModelConfig};

pub use kv_pool::{KvPool, Reservation};
pub use kv_quant::KvQuant;
pub use loader::LoadedModel;
pub use model::Model;
pub use shared::SharedModel;

pub type Result<T> = anyhow::Result<T>;

#[doc(hidden)]
pub use engine_core as __engine_core;
