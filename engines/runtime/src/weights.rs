//! Named weight arrays: every `*.safetensors` file of a model directory, or
//! the tensors of a GGUF file (see [`crate::gguf`]).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context};
use mlx_rs::{Array, Dtype};

use crate::config::{ModelConfig, Quantization};

pub struct Weights {
    tensors: HashMap<String, Array>,
    /// Per-layer quantization (by weight prefix) where it differs from the
    /// config's, as in GGUF files that mix block types.
    quantization: HashMap<String, Quantization>,
    /// The file each tensor came from (kept after `take`, for errors).
    files: HashMap<String, PathBuf>,
    origin: Origin,
    /// Whether packed decoder-layer linears keep a copy expanded to the
    /// compute dtype ([`Weights::keep_dense_copies`]).
    dense_copies: bool,
    /// Scales and biases kept in fp16 for the packed kernel
    /// ([`Weights::keep_half_scales`]).
    half_scales: HashSet<String>,
    /// The dtype [`Weights::cast_floats`] cast to.
    cast_to: Option<Dtype>,
}

/// Where a checkpoint's tensors were read from, for errors.
enum Origin {
    /// The `*.safetensors` files of a directory.
    Dir(PathBuf),
    /// One GGUF file.
    Gguf(PathBuf),
}

impl Origin {
    fn path(&self) -> &Path {
        match self {
            Origin::Dir(p) | Origin::Gguf(p) => p,
        }
    }
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Dir(dir) => write!(f, "*.safetensors in {}", dir.display()),
            Origin::Gguf(file) => write!(f, "{}", file.display()),
        }
    }
}

impl Weights {
    pub fn from_dir(dir: &Path) -> anyhow::Result<Self> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .with_context(|| format!("reading model directory {}", dir.display()))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            anyhow::bail!("no *.safetensors files in {}", dir.display());
        }
        let mut tensors = HashMap::new();
        let mut names = HashMap::new();
        for file in files {
            let loaded = Array::load_safetensors(&file)
                .map_err(|e| anyhow!("loading {}: {e}", file.display()))?;
            for (name, array) in loaded {
                let canonical = canonical_name(&name);
                names.insert(canonical.clone(), file.clone());
                tensors.insert(canonical, array);
            }
        }
        Ok(Self {
            tensors,
            quantization: HashMap::new(),
            files: names,
            origin: Origin::Dir(dir.to_path_buf()),
            dense_copies: false,
            half_scales: HashSet::new(),
            cast_to: None,
        })
    }

    /// No tensors yet; those inserted come from the GGUF file `path`.
    pub fn from_gguf(path: &Path) -> Self {
        Self {
            tensors: HashMap::new(),
            quantization: HashMap::new(),
            files: HashMap::new(),
            origin: Origin::Gguf(path.to_path_buf()),
            dense_copies: false,
            half_scales: HashSet::new(),
            cast_to: None,
        }
    }

    pub fn insert(&mut self, name: String, array: Array) {
        self.tensors.insert(name, array);
    }

    pub fn set_quantization(&mut self, prefix: String, q: Quantization) {
        self.quantization.insert(prefix, q);
    }

    /// The quantization of the layer at `prefix`, if it has its own.
    pub fn quantization(&self, prefix: &str) -> Option<Quantization> {
        self.quantization.get(prefix).copied()
    }

    pub fn take(&mut self, name: &str) -> anyhow::Result<Array> {
        self.tensors.remove(name).ok_or_else(|| {
            anyhow!(
                "weight `{name}` missing from the checkpoint ({})",
                self.origin
            )
        })
    }

    /// [`Weights::take`] of a tensor that must have `shape`.
    pub fn take_shaped(&mut self, name: &str, shape: &[i32]) -> anyhow::Result<Array> {
        let a = self.take(name)?;
        self.check_shape(name, &a, shape)?;
        Ok(a)
    }

    /// An error naming the tensor and its file unless `a` has `shape`.
    pub fn check_shape(&self, name: &str, a: &Array, shape: &[i32]) -> anyhow::Result<()> {
        if a.shape() != shape {
            anyhow::bail!(
                "tensor `{name}` in {} has shape {:?}, expected {shape:?}",
                self.file_of(name),
                a.shape()
            );
        }
        Ok(())
    }

    /// The file a tensor was read from, for messages.
    pub fn file_of(&self, name: &str) -> String {
        self.files
            .get(name)
            .map_or(self.origin.path(), PathBuf::as_path)
            .display()
            .to_string()
    }

    pub fn take_optional(&mut self, name: &str) -> Option<Array> {
        self.tensors.remove(name)
    }

    /// A tensor still held, without taking it.
    pub fn peek(&self, name: &str) -> Option<&Array> {
        self.tensors.get(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn remaining(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// Packed quantized layers (by prefix) and their quantization: their
    /// own (GGUF), else the config's for that layer, as [`Linear::load`]
    /// reads it.
    ///
    /// [`Linear::load`]: crate::layers::Linear::load
    fn packed(&self, config: &ModelConfig) -> Vec<(String, Quantization)> {
        self.tensors
            .keys()
            .filter_map(|n| n.strip_suffix(".scales"))
            .filter(|p| self.tensors.contains_key(&format!("{p}.weight")))
            .filter_map(|p| {
                let q = self.quantization(p).or_else(|| config.quant_for(p))?;
                Some((p.to_string(), q))
            })
            .collect()
    }

    /// Whether the project's packed kernel ([`crate::packed`]) multiplies
    /// every packed quantized layer: 2-D weights of a width it takes.
    pub fn packed_kernel_takes_all(&self, config: &ModelConfig) -> bool {
        self.packed(config).iter().all(|(p, q)| {
            self.tensors[&format!("{p}.weight")].ndim() == 2
                && crate::packed::supports(q.bits, q.group_size)
        })
    }

    /// Bytes the packed quantized layers would take expanded to their
    /// scales' dtype.
    pub fn expanded_bytes(&self, config: &ModelConfig) -> u64 {
        self.expanded_bytes_of(config, |_, _| true)
    }

    /// [`Weights::expanded_bytes`] of the packed layers `which` picks (by
    /// prefix and packed weight).
    fn expanded_bytes_of(&self, config: &ModelConfig, which: impl Fn(&str, &Array) -> bool) -> u64 {
        self.packed(config)
            .iter()
            .map(|(p, q)| (&self.tensors[&format!("{p}.weight")], p, q))
            .filter(|(w, p, _)| which(p, w))
            .map(|(w, p, q)| {
                let s = &self.tensors[&format!("{p}.scales")];
                (w.size() * 32 / q.bits as usize * s.item_size()) as u64
            })
            .sum()
    }

    /// Bytes of every tensor held.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.nbytes() as u64).sum()
    }

    /// Bytes that [`Weights::keep_dense_copies`] would add: the packed
    /// decoder-layer linears (not embeddings, not the 3-D expert stacks)
    /// expanded to their scales' dtype.
    pub fn dense_copy_bytes(&self, config: &ModelConfig) -> u64 {
        self.expanded_bytes_of(config, Self::takes_dense_copy)
    }

    /// From now on, packed decoder-layer linears loaded from these weights
    /// also keep a copy expanded to the compute dtype
    /// ([`crate::ComputeDtype::keeps_dense_copies`]).
    pub fn keep_dense_copies(&mut self) {
        self.dense_copies = true;
    }

    /// Whether the packed linear at `prefix` (its packed `weight`) keeps an
    /// expanded copy.
    pub fn keeps_dense_copy(&self, prefix: &str, weight: &Array) -> bool {
        self.dense_copies && Self::takes_dense_copy(prefix, weight)
    }

    fn takes_dense_copy(prefix: &str, weight: &Array) -> bool {
        prefix.starts_with("model.layers.") && weight.ndim() == 2
    }

    /// Expands every packed quantized layer to its scales' dtype (dense),
    /// lazily like [`Weights::cast_floats`].
    pub fn expand_packed(&mut self, config: &ModelConfig) -> anyhow::Result<()> {
        for (prefix, q) in self.packed(config) {
            let w = self.take(&format!("{prefix}.weight"))?;
            let s = self.take(&format!("{prefix}.scales"))?;
            let b = self.take(&format!("{prefix}.biases"))?;
            let dense = mlx_rs::ops::dequantize(&w, &s, &b, q.group_size, q.bits)?;
            self.tensors.insert(format!("{prefix}.weight"), dense);
            self.quantization.remove(&prefix);
        }
        Ok(())
    }

    /// Keeps the scales and biases of the packed layers that the project's
    /// kernel ([`crate::packed`]) multiplies in fp16 where the checkpoint
    /// stores them in half precision, instead of [`Weights::cast_floats`]
    /// widening them: a step streams them with the packed weights, and in
    /// fp32 they are a third of its bytes at 4 bits in groups of 32. GGUF's
    /// Q4_0, Q4_1 and Q8_0 store fp16 (kept as they are); bf16 converts to
    /// fp16 exactly from 2^-14 in magnitude (fp16's smallest normal number)
    /// up, with fp16's absolute step of 2^-24 below. fp32 ones stay fp32.
    pub fn keep_half_scales(&mut self, config: &ModelConfig) -> anyhow::Result<()> {
        for (prefix, q) in self.packed(config) {
            let (s, b) = (format!("{prefix}.scales"), format!("{prefix}.biases"));
            let served = self.tensors[&format!("{prefix}.weight")].ndim() == 2
                && crate::packed::supports(q.bits, q.group_size);
            let half = |t: Option<&Array>| {
                t.is_some_and(|t| matches!(t.dtype(), Dtype::Float16 | Dtype::Bfloat16))
            };
            if !served || !half(self.tensors.get(&s)) || !half(self.tensors.get(&b)) {
                continue;
            }
            for name in [s, b] {
                let t = self.tensors.get_mut(&name).expect("checked above");
                *t = t.as_dtype(Dtype::Float16)?;
                self.half_scales.insert(name);
            }
        }
        Ok(())
    }

    /// The dtype the layer at `prefix` (a linear or an embedding table)
    /// gives its products and rows in: its scales' (or weight's), or the
    /// compute dtype where its scales stay in fp16
    /// ([`Weights::keep_half_scales`]). `None` where it has no tensors.
    pub fn layer_dtype(&self, prefix: &str) -> Option<Dtype> {
        let scales = format!("{prefix}.scales");
        if let Some(dtype) = self.cast_to.filter(|_| self.half_scales.contains(&scales)) {
            return Some(dtype);
        }
        self.tensors
            .get(&scales)
            .or_else(|| self.tensors.get(&format!("{prefix}.weight")))
            .map(|t| t.dtype())
    }

    /// Casts every floating-point tensor to `dtype` (lazily: the copy is
    /// made when the weights are evaluated, and the checkpoint's arrays are
    /// dropped then), except scales and biases kept in fp16
    /// ([`Weights::keep_half_scales`]).
    pub fn cast_floats(&mut self, dtype: Dtype) -> anyhow::Result<()> {
        self.cast_to = Some(dtype);
        for (name, t) in self.tensors.iter_mut() {
            if self.half_scales.contains(name) {
                continue;
            }
            // Qwen 3.5's decay rates stay in their own precision (as
            // mlx-lm's cast predicate keeps them).
            if name.ends_with(".A_log") {
                continue;
            }
            if crate::compute::casts(t.dtype()) && t.dtype() != dtype {
                *t = t.as_dtype(dtype)?;
            }
        }
        Ok(())
    }
}

/// Multimodal checkpoints prefix the text model: `language_model.model.*`
/// (Hugging Face before Transformers 5, MLX conversions) or
/// `model.language_model.*` with `model.vision_tower.*` and
/// `model.multi_modal_projector.*` (Gemma 3) or `model.embed_vision.*`
/// (Gemma 4) beside it (Transformers 5). Both become `model.*`,
/// `vision_tower.*`, `multi_modal_projector.*` and `embed_vision.*`.
pub fn canonical_name(name: &str) -> String {
    if let Some(rest) = name.strip_prefix("language_model.") {
        return rest.to_string();
    }
    if let Some(rest) = name.strip_prefix("model.language_model.") {
        return format!("model.{rest}");
    }
    for part in ["vision_tower.", "multi_modal_projector.", "embed_vision."] {
        if let Some(rest) = name.strip_prefix("model.").filter(|r| r.starts_with(part)) {
            return rest.to_string();
        }
    }
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::canonical_name;

    #[test]
    fn multimodal_layouts_map_to_one_naming() {
        for (given, want) in [
            (
                "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.mlp.up_proj.weight",
            ),
            ("language_model.model.norm.weight", "model.norm.weight"),
            ("model.language_model.norm.weight", "model.norm.weight"),
            (
                "model.vision_tower.vision_model.post_layernorm.bias",
                "vision_tower.vision_model.post_layernorm.bias",
            ),
            (
                "model.multi_modal_projector.mm_input_projection_weight",
                "multi_modal_projector.mm_input_projection_weight",
            ),
            (
                "vision_tower.vision_model.post_layernorm.bias",
                "vision_tower.vision_model.post_layernorm.bias",
            ),
            // Gemma 4's projection beside its tower.
            (
                "model.embed_vision.embedding_projection.weight",
                "embed_vision.embedding_projection.weight",
            ),
            (
                "embed_vision.embedding_projection.weight",
                "embed_vision.embedding_projection.weight",
            ),
            ("lm_head.weight", "lm_head.weight"),
        ] {
            assert_eq!(canonical_name(given), want);
        }
    }
}
