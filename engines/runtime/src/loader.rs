//! A model (Hugging Face directory or GGUF file) loaded once: weights, tokenizer, chat template and the
//! full stop-token set. The gateway shares one `LoadedModel` (behind an
//! `Arc`) with every engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use mlx_rs::Array;

use crate::compute::ComputeDtype;
use crate::config::ModelConfig;
use crate::device::{DeviceGuard, DeviceLock, LocalDeviceLock};
use crate::model::Model;
use crate::vision::{VisionConfig, VisionTower};
use crate::weights::Weights;
use engine_core::TokenizerSource;

pub struct LoadedModel {
    /// The model directory (for a GGUF file, the directory holding it).
    pub dir: PathBuf,
    /// The checkpoint as given: the directory, or the GGUF file.
    pub path: PathBuf,
    /// The dtype the weights were cast to at load.
    pub compute: ComputeDtype,
    /// The name the API serves the model under.
    pub name: String,
    pub model: Model,
    /// The vision tower of a multimodal checkpoint (Gemma 3), `None` for
    /// text-only models.
    pub vision: Option<VisionTower>,
    pub tokenizer: Arc<text::Tokenizer>,
    /// Where the tokenizer came from, for a plugin that needs its own copy.
    pub tokenizer_source: TokenizerSource,
    pub template: Option<text::ChatTemplate>,
    /// Every token that ends a generation (config, generation config,
    /// tokenizer config, end-of-turn tokens), the same for every engine.
    pub stop_tokens: Vec<u32>,
    /// The sampling the checkpoint recommends ([`crate::generation_config`]).
    pub sampling_defaults: engine_core::SamplingDefaults,
    /// Serialises device work across engines (the host's lock, or the
    /// host's through C in a plugin).
    pub(crate) device: Arc<dyn DeviceLock>,
}

// MLX arrays are reference-counted handles to immutable buffers; the weights
// are never mutated after load, and device work is serialised by `device`.
unsafe impl Sync for LoadedModel {}

impl LoadedModel {
    /// Loads with the compute dtype chosen for the device
    /// ([`ComputeDtype::Auto`]).
    pub fn load(path: &Path, name: Option<&str>) -> anyhow::Result<Self> {
        Self::load_as(path, name, ComputeDtype::Auto)
    }

    /// Loads a Hugging Face model directory, a GGUF file, or a directory
    /// holding one GGUF file (and no safetensors).
    pub fn load_as(path: &Path, name: Option<&str>, compute: ComputeDtype) -> anyhow::Result<Self> {
        let started = Instant::now();
        let built = build(path, compute)?;
        let params = parameters(&built.model, built.vision.as_ref());
        // Materialise the weights now, not on the first request.
        mlx_rs::transforms::eval(params.iter().copied())?;
        let weight_bytes: usize = params.iter().map(|a| a.nbytes()).sum();
        let loaded = Self::assemble(built, name, compute, Arc::new(LocalDeviceLock::default()))?;
        tracing::info!(
            model = %loaded.name,
            family = %loaded.model.config.family,
            layers = loaded.model.config.num_layers,
            hidden = loaded.model.config.hidden_size,
            dtype = ?loaded.model.dtype(),
            compute_dtype = ?compute,
            weight_mb = weight_bytes >> 20,
            kv_bytes_per_token = loaded.model.kv_bytes_per_token(),
            blas = %mlx_sys::blas_backend(),
            seconds = started.elapsed().as_secs_f32(),
            "model loaded"
        );
        Ok(loaded)
    }

    /// A plugin's view of the host's model: the same structure built from
    /// the checkpoint (lazily for safetensors), each array then pointed at
    /// the host's evaluated array (`host`, handles of the host's arrays),
    /// so the weights are in memory once.
    pub(crate) fn view(
        path: &Path,
        name: &str,
        compute: ComputeDtype,
        host: Vec<Array>,
        device: Arc<dyn DeviceLock>,
    ) -> anyhow::Result<Self> {
        let built = build(path, compute)?;
        let mine = parameters(&built.model, built.vision.as_ref());
        anyhow::ensure!(
            mine.len() == host.len(),
            "the host's model has {} arrays, this plugin's build of {} has {}",
            host.len(),
            path.display(),
            mine.len()
        );
        // SAFETY: ours are owned by the model, which nothing else sees yet.
        unsafe {
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
        Self::assemble(built, Some(name), compute, device)
    }

    fn assemble(
        built: Built,
        name: Option<&str>,
        compute: ComputeDtype,
        device: Arc<dyn DeviceLock>,
    ) -> anyhow::Result<Self> {
        let Built {
            checkpoint,
            model,
            vision,
            tokenizer_source,
            template,
            metadata_stops,
            metadata_sampling,
        } = built;
        let tokenizer = Arc::new(text::Tokenizer::load(&tokenizer_source)?);
        // Files next to a GGUF (a tokenizer_config.json) add their stops.
        let mut stop_tokens = text::eos::eos_token_ids(checkpoint.dir(), &tokenizer)?;
        if let Some(ids) = metadata_stops {
            stop_tokens = text::eos::stop_set(ids.into_iter().chain(stop_tokens), &tokenizer);
        }
        let sampling_defaults = crate::generation_config::merged(
            metadata_sampling,
            crate::generation_config::from_dir(checkpoint.dir())?,
        );
        let name = name
            .map(str::to_string)
            .unwrap_or_else(|| checkpoint.default_name());
        Ok(Self {
            dir: checkpoint.dir().to_path_buf(),
            path: checkpoint.path().to_path_buf(),
            compute,
            name,
            model,
            vision,
            tokenizer,
            tokenizer_source,
            template,
            stop_tokens,
            sampling_defaults,
            device,
        })
    }

    /// Every weight array, the text model's then the vision tower's, in an
    /// order fixed by the model's structure.
    pub fn parameters(&self) -> Vec<&Array> {
        parameters(&self.model, self.vision.as_ref())
    }

    /// Exclusive use of the device; engines take it through
    /// `SharedModel::lock_device`. A panicked holder left nothing
    /// half-written that matters here.
    pub(crate) fn lock_device(&self) -> DeviceGuard<'_> {
        crate::device::lock(&*self.device)
    }

    pub fn vocab_size(&self) -> usize {
        self.model.config.vocab_size as usize
    }

    pub fn context_window(&self) -> usize {
        self.model.config.max_position_embeddings as usize
    }
}

/// Where a model's files are.
enum Checkpoint {
    /// A Hugging Face layout: config.json, *.safetensors, tokenizer files.
    Dir(PathBuf),
    /// One GGUF file, and the directory it is in (for a tokenizer.json or
    /// chat template placed next to it).
    Gguf { file: PathBuf, dir: PathBuf },
}

impl Checkpoint {
    fn find(path: &Path) -> anyhow::Result<Self> {
        let is_gguf = |p: &Path| p.extension().is_some_and(|e| e == "gguf");
        if path.is_file() {
            if !is_gguf(path) {
                anyhow::bail!("{}: a model is a directory or a .gguf file", path.display());
            }
            let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
            return Ok(Self::Gguf {
                file: path.to_path_buf(),
                dir,
            });
        }
        let entries: Vec<PathBuf> = std::fs::read_dir(path)
            .with_context(|| format!("reading model directory {}", path.display()))?
            .flatten()
            .map(|e| e.path())
            .collect();
        let has_safetensors = entries
            .iter()
            .any(|p| p.extension().is_some_and(|e| e == "safetensors"));
        let mut ggufs: Vec<_> = entries.into_iter().filter(|p| is_gguf(p)).collect();
        match (has_safetensors, ggufs.len()) {
            (false, 1) => Ok(Self::Gguf {
                file: ggufs.remove(0),
                dir: path.to_path_buf(),
            }),
            (false, n) if n > 1 => anyhow::bail!(
                "{} holds {n} .gguf files; name the one to serve",
                path.display()
            ),
            _ => Ok(Self::Dir(path.to_path_buf())),
        }
    }

    fn dir(&self) -> &Path {
        match self {
            Self::Dir(dir) | Self::Gguf { dir, .. } => dir,
        }
    }

    fn path(&self) -> &Path {
        match self {
            Self::Dir(dir) => dir,
            Self::Gguf { file, .. } => file,
        }
    }

    /// The directory's name, or the GGUF file's without `.gguf`.
    fn default_name(&self) -> String {
        let name = match self {
            Self::Dir(dir) => dir.file_name(),
            Self::Gguf { file, .. } => file.file_stem(),
        };
        name.map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    }
}

/// A checkpoint's model and text pipeline files, its weights unevaluated.
struct Built {
    checkpoint: Checkpoint,
    model: Model,
    vision: Option<VisionTower>,
    tokenizer_source: TokenizerSource,
    template: Option<text::ChatTemplate>,
    /// The end-of-generation tokens a GGUF file's metadata names.
    metadata_stops: Option<Vec<u32>>,
    /// The sampling a GGUF file's metadata recommends.
    metadata_sampling: engine_core::SamplingDefaults,
}

fn build(path: &Path, compute: ComputeDtype) -> anyhow::Result<Built> {
    let checkpoint = Checkpoint::find(path)?;
    let (config, mut weights, tokenizer_source, template, metadata_stops, metadata_sampling) =
        match &checkpoint {
            Checkpoint::Dir(dir) => (
                ModelConfig::from_dir(dir)?,
                Weights::from_dir(dir)?,
                TokenizerSource::Dir(dir.clone()),
                text::ChatTemplate::from_dir(dir)?,
                None,
                Default::default(),
            ),
            Checkpoint::Gguf { file, dir } => {
                let gguf = crate::gguf::load(file)?;
                let config = gguf.vocab.tokenizer_config();
                // A tokenizer.json (and template) next to the file wins over
                // the one rebuilt from the metadata.
                let tokenizer_source = if dir.join("tokenizer.json").exists() {
                    TokenizerSource::Dir(dir.clone())
                } else {
                    let json = gguf
                        .vocab
                        .tokenizer_json()
                        .with_context(|| format!("the tokenizer of {}", file.display()))?;
                    TokenizerSource::Json {
                        json,
                        config: config.clone(),
                        origin: file.clone(),
                    }
                };
                let template = match text::ChatTemplate::from_dir_or(dir, &config)? {
                    Some(t) => Some(t),
                    None => text::ChatTemplate::from_tokenizer_config(&config, file)?,
                };
                (
                    gguf.config,
                    gguf.weights,
                    tokenizer_source,
                    template,
                    Some(gguf.vocab.eos_token_ids()),
                    gguf.sampling,
                )
            }
        };
    if let Some(dtype) = compute.resolve() {
        if compute.keeps_half_scales(weights.packed_kernel_takes_all(&config)) {
            weights.keep_half_scales(&config)?;
        }
        weights.cast_floats(dtype)?;
    }
    if compute.expands_packed(
        weights.expanded_bytes(&config),
        weights.packed_kernel_takes_all(&config),
    ) {
        weights.expand_packed(&config)?;
    }
    if compute.keeps_dense_copies(weights.dense_copy_bytes(&config), weights.total_bytes()) {
        weights.keep_dense_copies();
    }
    let shown = checkpoint.path().display().to_string();
    let vision = match &checkpoint {
        Checkpoint::Dir(dir) => match VisionConfig::from_dir(dir)? {
            Some(v) => Some(
                VisionTower::load(v, &mut weights, config.quantization)
                    .with_context(|| format!("loading the vision tower of {shown}"))?,
            ),
            None => None,
        },
        Checkpoint::Gguf { .. } => None,
    };
    let model = Model::load(config, weights).with_context(|| format!("loading {shown}"))?;
    Ok(Built {
        checkpoint,
        model,
        vision,
        tokenizer_source,
        template,
        metadata_stops,
        metadata_sampling,
    })
}

fn parameters<'a>(model: &'a Model, vision: Option<&'a VisionTower>) -> Vec<&'a Array> {
    let mut all = model.parameters();
    if let Some(tower) = vision {
        tower.collect(&mut all);
    }
    all
}
