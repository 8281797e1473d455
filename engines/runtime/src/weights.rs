//! Reads every `*.safetensors` file of a model directory into named arrays.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, Context};
use mlx_rs::Array;

pub struct Weights {
    tensors: HashMap<String, Array>,
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
        for file in files {
            let loaded = Array::load_safetensors(&file)
                .map_err(|e| anyhow!("loading {}: {e}", file.display()))?;
            for (name, array) in loaded {
                // Multimodal checkpoints prefix the text model.
                let name = name
                    .strip_prefix("language_model.")
                    .unwrap_or(&name)
                    .to_string();
                tensors.insert(name, array);
            }
        }
        Ok(Self { tensors })
    }

    pub fn take(&mut self, name: &str) -> anyhow::Result<Array> {
        self.tensors
            .remove(name)
            .ok_or_else(|| anyhow!("weight `{name}` missing from the checkpoint"))
    }

    pub fn take_optional(&mut self, name: &str) -> Option<Array> {
        self.tensors.remove(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn remaining(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }
}
