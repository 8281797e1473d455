//! Generated models (random weights, real tokenizer and chat template),
//! written once per test process into a temporary directory.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use fixtures::gemma4::Layout;
use fixtures::model::{write_model, TinySpec};
use fixtures::vision::{
    write_gemma4_vision_model, write_vision_model, TinyGemma4VisionSpec, TinyVisionSpec,
};
use runtime::Family;

pub struct ModelDir {
    _dir: tempfile::TempDir,
    pub path: PathBuf,
}

/// The tiny Qwen3 model (a few hundred thousand parameters).
pub fn tiny_qwen3() -> &'static Path {
    static MODEL: OnceLock<ModelDir> = OnceLock::new();
    &MODEL
        .get_or_init(|| write("tiny-qwen3", &TinySpec::tiny(Family::Qwen3)))
        .path
}

/// The tiny Gemma 3 vision model (16 soft tokens per 56-pixel image), with a
/// 96-token context so the image tokens' share of it is visible in tests.
pub fn tiny_gemma3_vision() -> &'static Path {
    static MODEL: OnceLock<ModelDir> = OnceLock::new();
    &MODEL
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("tiny-gemma3-vision");
            let mut spec = TinyVisionSpec::tiny();
            spec.text.context = 96;
            write_vision_model(&path, &spec).expect("write vision model");
            ModelDir { _dir: dir, path }
        })
        .path
}

/// The tiny Gemma 4 vision model (up to 16 soft tokens, as many as the
/// image's shape gives), causal image attention.
pub fn tiny_gemma4_vision() -> &'static Path {
    static MODEL: OnceLock<ModelDir> = OnceLock::new();
    &MODEL
        .get_or_init(|| gemma4_vision("tiny-gemma4-vision", false))
        .path
}

/// The same with `use_bidirectional_attention: vision` in its config.
pub fn tiny_gemma4_vision_bidirectional() -> &'static Path {
    static MODEL: OnceLock<ModelDir> = OnceLock::new();
    &MODEL
        .get_or_init(|| gemma4_vision("tiny-gemma4-vision-bidi", true))
        .path
}

fn gemma4_vision(name: &str, bidirectional: bool) -> ModelDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(name);
    let spec = TinyGemma4VisionSpec {
        bidirectional,
        ..TinyGemma4VisionSpec::tiny(Layout::HfMultimodal)
    };
    write_gemma4_vision_model(&path, &spec).expect("write vision model");
    ModelDir { _dir: dir, path }
}

/// The tiny Qwen3 model with a chat template that opens the think block in
/// the prompt (as reasoning models' templates do); random weights never
/// close it.
pub fn tiny_qwen3_thinking() -> &'static Path {
    static MODEL: OnceLock<ModelDir> = OnceLock::new();
    &MODEL
        .get_or_init(|| {
            let dir = write("tiny-qwen3", &TinySpec::tiny(Family::Qwen3));
            let config_path = dir.path.join("tokenizer_config.json");
            let mut config: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
            let template = config["chat_template"].as_str().unwrap();
            let opened = template.replace(
                "{{- '<|im_start|>assistant\\n' }}",
                "{{- '<|im_start|>assistant\\n<think>\\n' }}",
            );
            assert_ne!(opened, template, "the template's generation prompt moved");
            config["chat_template"] = opened.into();
            std::fs::write(&config_path, config.to_string()).unwrap();
            dir
        })
        .path
}

/// Writes a model of `spec` into a fresh temporary directory named `name`.
pub fn write(name: &str, spec: &TinySpec) -> ModelDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(name);
    write_model(&path, spec).expect("write model");
    ModelDir { _dir: dir, path }
}

/// Every token id that ends generation for the model in `dir`.
pub fn stop_token_ids(dir: &Path) -> Vec<u32> {
    let tokenizer = text::Tokenizer::from_dir(dir).expect("tokenizer");
    text::eos::eos_token_ids(dir, &tokenizer).expect("eos ids")
}

/// A random-weight drafter of `kind` (`dflash` or `mtp`) for the tiny Qwen3
/// model, written by `fixtures make-tiny-drafter` (the CLI under test).
pub fn tiny_qwen3_drafter(kind: &str) -> &'static Path {
    static DFLASH: OnceLock<ModelDir> = OnceLock::new();
    static MTP: OnceLock<ModelDir> = OnceLock::new();
    let cell = match kind {
        "dflash" => &DFLASH,
        "mtp" => &MTP,
        other => panic!("no drafter kind {other}"),
    };
    &cell.get_or_init(|| drafter(kind, tiny_qwen3())).path
}

/// A random-weight drafter of `kind` (`dflash` or `mtp`) for the model in
/// `target`, written by `fixtures make-tiny-drafter` (the CLI under test).
pub fn drafter(kind: &str, target: &Path) -> ModelDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let name = target.file_name().expect("a named model directory");
    let path = dir
        .path()
        .join(format!("{}-{kind}", name.to_string_lossy()));
    let status = std::process::Command::new(&crate::build::binaries().fixtures)
        .args(["make-tiny-drafter", "--kind", kind, "--target"])
        .arg(target)
        .arg("--out")
        .arg(&path)
        .status()
        .expect("run make-tiny-drafter");
    assert!(status.success(), "make-tiny-drafter --kind {kind} failed");
    ModelDir { _dir: dir, path }
}
