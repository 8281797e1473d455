//! A checkpoint the runtime cannot serve fails at load with a message that
//! names the file and the tensor (or the config field) at fault.

use std::collections::HashMap;
use std::path::Path;

use fixtures::gemma4::{Gemma4Shape, Layout};
use fixtures::model::{write_model, TinySpec};
use mlx_rs::Array;
use runtime::LoadedModel;

fn tiny(dir: &Path, quant_bits: Option<i32>) {
    let spec = TinySpec {
        quant_bits,
        ..TinySpec::gemma4(Gemma4Shape {
            layout: Layout::HfText,
            ..Gemma4Shape::moe_26b(4)
        })
    };
    write_model(dir, &spec).unwrap();
}

fn load_error(dir: &Path) -> String {
    match LoadedModel::load(dir, None) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, v.to_string()).unwrap();
}

fn edit_tensors(dir: &Path, edit: impl FnOnce(&mut HashMap<String, Array>)) {
    let path = dir.join("model.safetensors");
    let mut tensors = Array::load_safetensors(&path).unwrap();
    // Read everything before the file is overwritten.
    mlx_rs::transforms::eval(tensors.values()).unwrap();
    edit(&mut tensors);
    Array::save_safetensors(tensors.iter(), &HashMap::new(), &path).unwrap();
}

#[test]
fn the_tiny_model_itself_loads() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path(), None);
    LoadedModel::load(dir.path(), None).unwrap();
}

#[test]
fn an_unknown_model_type_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path(), None);
    edit_config(dir.path(), |c| c["model_type"] = "gemma9_text".into());
    let err = load_error(dir.path());
    assert!(
        err.contains("gemma9_text") && err.contains("config.json"),
        "{err}"
    );
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path(), None);
    let name = "model.layers.2.experts.down_proj";
    edit_tensors(dir.path(), |t| {
        t.remove(name).unwrap();
    });
    let err = load_error(dir.path());
    assert!(err.contains(name) && err.contains("missing"), "{err}");
}

#[test]
fn a_misshapen_tensor_is_named_with_its_file() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path(), None);
    let name = "model.layers.1.self_attn.o_proj.weight";
    edit_tensors(dir.path(), |t| {
        t.insert(name.into(), Array::zeros::<f32>(&[64, 48]).unwrap());
    });
    let err = load_error(dir.path());
    assert!(
        err.contains(name) && err.contains("model.safetensors") && err.contains("[64, 48]"),
        "{err}"
    );
    // Experts with the wrong count, too.
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path(), None);
    let name = "model.layers.0.experts.gate_up_proj";
    edit_tensors(dir.path(), |t| {
        t.insert(name.into(), Array::zeros::<f32>(&[7, 128, 64]).unwrap());
    });
    let err = load_error(dir.path());
    assert!(
        err.contains(name) && err.contains("model.safetensors"),
        "{err}"
    );
}

#[test]
fn a_quantization_the_runtime_cannot_run_is_refused() {
    for (field, value, expect) in [
        ("mode", serde_json::json!("mxfp4"), "mxfp4"),
        ("bits", serde_json::json!(7), "7 bits"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path(), Some(4));
        edit_config(dir.path(), |c| c["quantization"][field] = value);
        let err = load_error(dir.path());
        assert!(err.contains(expect) && err.contains("config.json"), "{err}");
    }
    // Quantized tensors the config says nothing about.
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path(), Some(4));
    edit_config(dir.path(), |c| {
        c.as_object_mut().unwrap().remove("quantization");
    });
    let err = load_error(dir.path());
    assert!(
        err.contains("is quantized") && err.contains("model.safetensors"),
        "{err}"
    );
}

/// Qwen 3.5 checkpoints: a layer kind the runtime does not run is refused
/// naming it and its layer; a misshapen linear-attention tensor is named.
mod qwen35 {
    use super::*;
    use fixtures::qwen::QwenShape;

    fn tiny(dir: &Path) {
        write_model(dir, &TinySpec::qwen(QwenShape::qwen35())).unwrap();
    }

    #[test]
    fn an_unsupported_layer_type_is_named() {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path());
        LoadedModel::load(dir.path(), None).unwrap();
        edit_config(dir.path(), |c| {
            c["text_config"]["layer_types"][1] = "sliding_attention".into()
        });
        let err = load_error(dir.path());
        assert!(
            err.contains("sliding_attention") && err.contains("layer 1"),
            "{err}"
        );
    }

    #[test]
    fn a_misshapen_convolution_is_named() {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path());
        let name = "model.language_model.layers.0.linear_attn.conv1d.weight";
        edit_tensors(dir.path(), |t| {
            t.insert(name.to_string(), Array::zeros::<f32>(&[3, 1, 4]).unwrap());
        });
        let err = load_error(dir.path());
        assert!(
            err.contains("model.layers.0.linear_attn.conv1d.weight")
                && err.contains("model.safetensors"),
            "{err}"
        );
    }
}

/// Gemma 4 multimodal checkpoints: the vision tower's tensors are checked
/// like the text model's.
mod gemma4_vision {
    use super::*;
    use fixtures::vision::{write_gemma4_vision_model, TinyGemma4VisionSpec};

    fn tiny(dir: &Path) {
        write_gemma4_vision_model(dir, &TinyGemma4VisionSpec::tiny(Layout::HfMultimodal)).unwrap();
    }

    #[test]
    fn the_tiny_vision_model_loads_its_tower() {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path());
        let model = LoadedModel::load(dir.path(), None).unwrap();
        assert!(model.vision.is_some());
    }

    #[test]
    fn a_missing_tower_tensor_is_named() {
        for name in [
            "model.vision_tower.encoder.layers.1.mlp.up_proj.linear.weight",
            "model.vision_tower.encoder.layers.0.self_attn.k_proj.output_max",
            "model.embed_vision.embedding_projection.weight",
        ] {
            let dir = tempfile::tempdir().unwrap();
            tiny(dir.path());
            edit_tensors(dir.path(), |t| {
                t.remove(name).unwrap();
            });
            let err = load_error(dir.path());
            let canonical = name.strip_prefix("model.").unwrap();
            assert!(err.contains(canonical) && err.contains("missing"), "{err}");
        }
    }

    #[test]
    fn a_misshapen_tower_tensor_is_named_with_its_file() {
        for (name, shape) in [
            (
                "model.vision_tower.patch_embedder.position_embedding_table",
                vec![2, 16, 32],
            ),
            (
                "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight",
                vec![32, 32 + 1],
            ),
            ("model.vision_tower.std_scale", vec![31]),
        ] {
            let dir = tempfile::tempdir().unwrap();
            tiny(dir.path());
            edit_tensors(dir.path(), |t| {
                t.insert(name.into(), Array::zeros::<f32>(&shape).unwrap());
            });
            let err = load_error(dir.path());
            let canonical = name.strip_prefix("model.").unwrap();
            assert!(
                err.contains(canonical) && err.contains("model.safetensors"),
                "{err}"
            );
        }
    }

    #[test]
    fn an_unsupported_attention_setting_is_named() {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path());
        edit_config(dir.path(), |c| {
            c["text_config"]["use_bidirectional_attention"] = "all".into()
        });
        let err = load_error(dir.path());
        assert!(
            err.contains("use_bidirectional_attention") && err.contains("config.json"),
            "{err}"
        );
    }
}
