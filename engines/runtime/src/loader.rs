//! A model directory loaded once: weights, tokenizer, chat template and the
//! full stop-token set. The gateway shares one `LoadedModel` (behind an
//! `Arc`) with every engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use mlx_rs::Array;

use crate::abi::{DeviceLock, DeviceGuard};
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
    /// evaluate from several threads at once. The host owns the lock;
    /// plugins take it through C calls.
    pub(crate) device: DeviceLock,
}

// MLX arrays are reference-counted handles to immutable buffers; the weights
// are never mutated after load, and device work is serialised by `device`.
unsafe impl Sync for LoadedModel {}

impl LoadedModel {
    pub fn load(dir: &Path, name: Option<&str>) -> anyhow::Result<Self> {
        let started = Instant::now();
        let (model, vision) = build(dir)?;
        // Materialise the weights now, not on the first request.
        mlx_rs::transforms::eval(parameters(&model, vision.as_ref()))?;
        let loaded = Self::assemble(dir, name, model, vision, DeviceLock::new())?;
        tracing::info!(
            model = %loaded.name,
            family = %loaded.model.config.family,
            layers = loaded.model.config.num_layers,
            hidden = loaded.model.config.hidden_size,
            dtype = ?loaded.model.dtype(),
            blas = %mlx_sys::blas_backend(),
            seconds = started.elapsed().as_secs_f32(),
            "model loaded"
        );
        Ok(loaded)
    }

    /// A plugin's view of the host's model: the same structure built from
    /// the checkpoint's lazy (never read) arrays, each then pointed at the
    /// host's evaluated array, so the weights are in memory once.
    pub(crate) fn view(
        dir: &Path,
        name: &str,
        host: &[mlx_sys::mlx_array],
        device: DeviceLock,
    ) -> anyhow::Result<Self> {
        let (model, vision) = build(dir)?;
        let mine = parameters(&model, vision.as_ref());
        anyhow::ensure!(
            mine.len() == host.len(),
            "the host's model has {} arrays, this plugin's build of {} has {}",
            host.len(),
            dir.display(),
            mine.len()
        );
        // SAFETY: the host's handles are live for the process; ours are
        // owned by the model, which nothing else sees yet.
        unsafe {
            let host: Vec<Array> = host.iter().map(|&h| crate::abi::retain(h)).collect();
            for (i, (m, h)) in mine.iter().zip(&host).enumerate() {
                anyhow::ensure!(
                    m.shape() == h.shape() && m.dtype() == h.dtype(),
                    "array {i} of the model differs between the host ({:?} {:?}) and this plugin ({:?} {:?})",
                    h.shape(),
                    h.dtype(),
                    m.shape(),
                    m.dtype()
                );
            }
            for (m, h) in mine.iter().zip(&host) {
                // mlx-c assigns into the array object behind our handle.
                let mut handle = m.as_ptr();
                mlx_sys::mlx_array_set(&mut handle, h.as_ptr());
            }
        }
        Self::assemble(dir, Some(name), model, vision, device)
    }

    fn assemble(
        dir: &Path,
        name: Option<&str>,
        model: Model,
        vision: Option<VisionTower>,
        device: DeviceLock,
    ) -> anyhow::Result<Self> {
        let tokenizer = Arc::new(text::Tokenizer::from_dir(dir)?);
        let template = text::ChatTemplate::from_dir(dir)?;
        let stop_tokens = text::eos::eos_token_ids(dir, &tokenizer)?;
        let name = name.map(str::to_string).unwrap_or_else(|| {
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        });
        Ok(Self {
            dir: dir.to_path_buf(),
            name,
            model,
            vision,
            tokenizer,
            template,
            stop_tokens,
            device,
        })
    }

    /// Every weight array, the text model's then the vision tower's, in an
    /// order fixed by the model's structure.
    pub fn parameters(&self) -> Vec<&Array> {
        parameters(&self.model, self.vision.as_ref())
    }

    /// Exclusive use of the device for one engine step (or one fast-path
    /// run). A panicked holder left nothing half-written that matters here.
    pub fn lock_device(&self) -> DeviceGuard<'_> {
        self.device.lock()
    }

    pub fn vocab_size(&self) -> usize {
        self.model.config.vocab_size as usize
    }

    pub fn context_window(&self) -> usize {
        self.model.config.max_position_embeddings as usize
    }
}

/// The model (and vision tower) of a checkpoint directory, unevaluated.
fn build(dir: &Path) -> anyhow::Result<(Model, Option<VisionTower>)> {
    let config = ModelConfig::from_dir(dir)?;
    let mut weights = Weights::from_dir(dir)?;
    let vision = match VisionConfig::from_dir(dir)? {
        Some(v) => Some(
            VisionTower::load(v, &mut weights, config.quantization)
                .with_context(|| format!("loading the vision tower of {}", dir.display()))?,
        ),
        None => None,
    };
    let model = Model::load(config, weights).with_context(|| format!("loading {}", dir.display()))?;
    Ok((model, vision))
}

fn parameters<'a>(model: &'a Model, vision: Option<&'a VisionTower>) -> Vec<&'a Array> {
    let mut all = model.parameters();
    if let Some(tower) = vision {
        tower.collect(&mut all);
    }
    all
}
