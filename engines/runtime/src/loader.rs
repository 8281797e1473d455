//! A model directory loaded once: weights, tokenizer, chat template and the
//! full stop-token set. The gateway shares one `LoadedModel` (behind an
//! `Arc`) with every engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use std::sync::{Mutex, MutexGuard};

use crate::compute::ComputeDtype;
use crate::config::ModelConfig;
use crate::model::Model;
use crate::vision::{VisionConfig, VisionTower};
use crate::weights::Weights;

pub struct LoadedModel {
    pub dir: PathBuf,
    /// The name the API serves the model under.
    pub name: String,
    pub model: Model,
    /// The vision tower of a multimodal checkpoint (Gemma 3), `None` for
    /// text-only models.
    pub vision: Option<VisionTower>,
    pub tokenizer: Arc<text::Tokenizer>,
    pub template: Option<text::ChatTemplate>,
    /// Every token that ends a generation (config, generation config,
    /// tokenizer config, end-of-turn tokens), the same for every engine.
    pub stop_tokens: Vec<u32>,
    /// Serialises device work across engines: MLX streams are not safe to
    /// evaluate from several threads at once. A std (futex) mutex on
    /// purpose: each plugin links its own copy of parking_lot, whose parked
    /// threads live in a per-copy global table, so one plugin's unlock could
    /// never wake another plugin's waiter.
    device: Mutex<()>,
}

// MLX arrays are reference-counted handles to immutable buffers; the weights
// are never mutated after load, and device work is serialised by `device`.
unsafe impl Sync for LoadedModel {}

impl LoadedModel {
    /// Loads with the compute dtype chosen for the device
    /// ([`ComputeDtype::Auto`]).
    pub fn load(dir: &Path, name: Option<&str>) -> anyhow::Result<Self> {
        Self::load_as(dir, name, ComputeDtype::Auto)
    }

    pub fn load_as(dir: &Path, name: Option<&str>, compute: ComputeDtype) -> anyhow::Result<Self> {
        let started = Instant::now();
        let config = ModelConfig::from_dir(dir)?;
        let mut weights = Weights::from_dir(dir)?;
        if let Some(dtype) = compute.resolve() {
            weights.cast_floats(dtype)?;
        }
        let vision = match VisionConfig::from_dir(dir)? {
            Some(v) => Some(
                VisionTower::load(v, &mut weights, config.quantization)
                    .with_context(|| format!("loading the vision tower of {}", dir.display()))?,
            ),
            None => None,
        };
        let model =
            Model::load(config, weights).with_context(|| format!("loading {}", dir.display()))?;
        // Materialise the weights now, not on the first request.
        let mut weight_bytes = model.eval_weights()?;
        if let Some(tower) = &vision {
            let mut all = Vec::new();
            tower.collect(&mut all);
            mlx_rs::transforms::eval(all.iter().copied())?;
            weight_bytes += all.iter().map(|a| a.nbytes()).sum::<usize>();
        }
        let tokenizer = Arc::new(text::Tokenizer::from_dir(dir)?);
        let template = text::ChatTemplate::from_dir(dir)?;
        let stop_tokens = text::eos::eos_token_ids(dir, &tokenizer)?;
        let name = name.map(str::to_string).unwrap_or_else(|| {
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        });
        tracing::info!(
            model = %name,
            family = %model.config.family,
            layers = model.config.num_layers,
            hidden = model.config.hidden_size,
            dtype = ?model.dtype(),
            compute_dtype = ?compute,
            weight_mb = weight_bytes >> 20,
            kv_bytes_per_token = model.kv_bytes_per_token(),
            blas = %mlx_sys::blas_backend(),
            seconds = started.elapsed().as_secs_f32(),
            "model loaded"
        );
        Ok(Self {
            dir: dir.to_path_buf(),
            name,
            model,
            vision,
            tokenizer,
            template,
            stop_tokens,
            device: Mutex::new(()),
        })
    }

    /// Exclusive use of the device for one engine step (or one fast-path
    /// run). A panicked holder left nothing half-written that matters here.
    pub fn lock_device(&self) -> MutexGuard<'_, ()> {
        self.device
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn vocab_size(&self) -> usize {
        self.model.config.vocab_size as usize
    }

    pub fn context_window(&self) -> usize {
        self.model.config.max_position_embeddings as usize
    }
}
