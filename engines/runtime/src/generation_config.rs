//! The sampling a checkpoint ships, which requests that leave a knob out
//! get (as vLLM's `--generation-config auto`): `generation_config.json`
//! (in a model directory, or next to a GGUF file) and a GGUF file's
//! `general.sampling.*` metadata, the JSON file winning key by key. A
//! `do_sample: false` file recommends greedy decoding (Transformers'
//! reading): only its repetition penalty is taken.

use std::path::Path;

use anyhow::Context;
use engine_core::SamplingDefaults;
use serde_json::Value;

use crate::gguf::file::{GgufFile, Value as Meta};

/// `generation_config.json` in `dir`; nothing when there is none.
pub fn from_dir(dir: &Path) -> anyhow::Result<SamplingDefaults> {
    let path = dir.join("generation_config.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(SamplingDefaults::default())
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let json: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let number = |key: &str| -> anyhow::Result<Option<f64>> {
        match json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .with_context(|| format!("{}: `{key}` must be a number, got {v}", path.display())),
        }
    };
    let repetition_penalty = number("repetition_penalty")?.map(|v| v as f32);
    // `do_sample: false`: Transformers decodes greedily whatever the
    // temperature says, and so does a request that leaves it out here.
    if json.get("do_sample") == Some(&Value::Bool(false)) {
        return Ok(SamplingDefaults {
            repetition_penalty,
            ..SamplingDefaults::default()
        });
    }
    Ok(SamplingDefaults {
        temperature: number("temperature")?.map(|v| v as f32),
        top_p: number("top_p")?.map(|v| v as f32),
        // HF's top_k 0 (or vLLM's -1): no truncation.
        top_k: number("top_k")?.map(|v| v.max(0.0) as u32),
        min_p: number("min_p")?.map(|v| v as f32),
        repetition_penalty,
    })
}

/// A GGUF file's `general.sampling.{temp, top_p, top_k, min_p,
/// penalty_repeat}` (llama.cpp's keys).
pub fn from_gguf(file: &GgufFile) -> SamplingDefaults {
    let number = |k: &str| {
        file.get(&format!("general.sampling.{k}"))
            .and_then(Meta::as_f64)
    };
    SamplingDefaults {
        temperature: number("temp").map(|v| v as f32),
        top_p: number("top_p").map(|v| v as f32),
        top_k: number("top_k").map(|v| v.max(0.0) as u32),
        min_p: number("min_p").map(|v| v as f32),
        repetition_penalty: number("penalty_repeat").map(|v| v as f32),
    }
}

/// `over`'s keys where it sets them, else `base`'s.
pub fn merged(base: SamplingDefaults, over: SamplingDefaults) -> SamplingDefaults {
    SamplingDefaults {
        temperature: over.temperature.or(base.temperature),
        top_p: over.top_p.or(base.top_p),
        top_k: over.top_k.or(base.top_k),
        min_p: over.min_p.or(base.min_p),
        repetition_penalty: over.repetition_penalty.or(base.repetition_penalty),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_knobs_a_generation_config_sets() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(from_dir(dir.path()).unwrap(), SamplingDefaults::default());
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"do_sample": true, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                "eos_token_id": [1, 2], "min_p": null}"#,
        )
        .unwrap();
        let d = from_dir(dir.path()).unwrap();
        assert_eq!(
            d,
            SamplingDefaults {
                temperature: Some(0.6),
                top_p: Some(0.95),
                top_k: Some(20),
                min_p: None,
                repetition_penalty: None,
            }
        );
        let gguf = SamplingDefaults {
            temperature: Some(1.0),
            min_p: Some(0.05),
            ..Default::default()
        };
        let both = merged(gguf, d);
        assert_eq!((both.temperature, both.min_p), (Some(0.6), Some(0.05)));
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"do_sample": false, "temperature": 0.6, "repetition_penalty": 1.1}"#,
        )
        .unwrap();
        assert_eq!(
            from_dir(dir.path()).unwrap(),
            SamplingDefaults {
                repetition_penalty: Some(1.1),
                ..Default::default()
            }
        );
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"temperature": "warm"}"#,
        )
        .unwrap();
        let err = format!("{:#}", from_dir(dir.path()).unwrap_err());
        assert!(err.contains("`temperature` must be a number"), "{err}");
    }
}
