//! GGUF files end to end: bad files are errors that name the problem, and
//! generated models of every family written the way llama.cpp's converter
//! writes them (fixtures::gguf) load to the logits of their Hugging Face
//! directories.

use fixtures::gguf::{convert, converted, write_convertible_model, write_gguf, Meta};
use fixtures::model::{write_model, TinySpec};
use fixtures::reference::{logit_rows, worst_difference};
use runtime::generate::prefill;
use runtime::gguf::GgufFile;
use runtime::{Family, LoadedModel};

fn tiny_gguf_meta(arch: &str) -> Vec<(&'static str, Meta)> {
    vec![("general.architecture", Meta::Str(arch.into()))]
}

#[test]
fn bad_files_are_clear_errors() {
    let tensor = (
        "token_embd.weight".to_string(),
        0,
        vec![4, 8],
        vec![0u8; 128],
    );
    let good = write_gguf(&tiny_gguf_meta("llama"), std::slice::from_ref(&tensor));
    assert!(GgufFile::parse(good.clone()).is_ok());
    // Cut anywhere: an error, never a panic.
    for cut in [0, 3, 10, 30, 60, good.len() - 200, good.len() - 1] {
        let err = GgufFile::parse(good[..cut].to_vec())
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("truncated") || err.contains("magic"),
            "cut {cut}: {err}"
        );
    }
    let err = GgufFile::parse(b"PK\x03\x04 not a gguf".to_vec())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("not a GGUF file"), "{err}");
    // A tensor type this runtime does not load is named with its tensor.
    let iq = write_gguf(
        &tiny_gguf_meta("llama"),
        &[("blk.0.attn_q.weight".into(), 19, vec![4, 256], vec![0; 200])],
    );
    let err = GgufFile::parse(iq).err().unwrap().to_string();
    assert!(
        err.contains("blk.0.attn_q.weight") && err.contains("IQ1_S"),
        "{err}"
    );
    // An architecture the runtime does not serve fails at load, named.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, write_gguf(&tiny_gguf_meta("mamba"), &[tensor])).unwrap();
    let err = format!("{:#}", LoadedModel::load(&path, None).err().unwrap());
    assert!(err.contains("`mamba`") && err.contains("m.gguf"), "{err}");
    // A tensor of another shape than the config's is named with the file.
    let hf = dir.path().join("hf");
    write_model(&hf, &TinySpec::tiny(Family::Llama)).unwrap();
    let (mut meta, tensors) = converted(&hf, Family::Llama);
    for (key, value) in meta.iter_mut() {
        if *key == "llama.feed_forward_length" {
            *value = Meta::U32(96);
        }
    }
    std::fs::write(&path, write_gguf(&meta, &tensors)).unwrap();
    let err = format!("{:#}", LoadedModel::load(&path, None).err().unwrap());
    let named = format!("mlp.gate_proj.weight` in {} has shape", path.display());
    assert!(err.contains(&named), "{err}");
}

#[test]
fn converted_generated_models_match_their_safetensors() {
    for family in [Family::Llama, Family::Qwen2, Family::Qwen3, Family::Gemma3] {
        let dir = tempfile::tempdir().unwrap();
        write_convertible_model(dir.path(), &TinySpec::tiny(family));
        let file = convert(dir.path(), family);

        let hf = LoadedModel::load(dir.path(), None).unwrap();
        let gguf = LoadedModel::load(&file, None).unwrap();
        assert_eq!(gguf.name, "tiny");
        assert_eq!(gguf.stop_tokens, hf.stop_tokens, "{family}");
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 500).collect();
        let logits = |m: &LoadedModel| {
            let mut cache = m.model.new_cache(1);
            logit_rows(&prefill(&m.model, &mut cache, &prompt, 512).unwrap())
        };
        let diff = worst_difference(&logits(&hf), &logits(&gguf));
        assert!(diff < 1e-4, "{family}: max logit difference {diff}");
    }
}
