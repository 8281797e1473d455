//! The default model, a real GGUF file (SmolLM2-135M-Instruct, Q4_1 with a
//! Q8_0 embedding), against an independent reading of it: MLX's own GGUF
//! loader (`mx.load`) for the tensors, run by mlx-lm, and transformers'
//! GGUF tokenizer conversion (scripts/gguf_reference.py). Tokenizer ids,
//! rendered chat prompts, greedy tokens and logits must agree.

use runtime::generate::{self, prefill};
use runtime::model::Logits;
use runtime::{ComputeDtype, LoadedModel};

const STEPS: usize = 24;
const LOGIT_STEPS: usize = 6;
const COMPUTE: &str = "float32";
const LOGIT_TOLERANCE: f32 = 0.05;

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn smollm2_gguf_matches_mlx_lm_and_transformers() {
    let gguf = fixtures::reference::default_gguf();
    let out = tempfile::tempdir().unwrap();
    let texts = [
        "Hello world! 12345 héllo",
        "def square(x):\n    return x ** 2  # 3.14",
        "Ünïcödé, emoji 🎉 and   spaces\n\n\ttabs",
        "<|im_start|>user\nspecial tokens<|im_end|>",
    ];
    let chats = fixtures::reference::chat_prompts();
    let reference = fixtures::reference::run(
        "gguf_reference.py",
        &serde_json::json!({"gguf": gguf, "out": out.path(), "texts": texts, "chats": chats}),
    );
    // `auto` computes in fp32 on the CPU, its packed weights through the
    // project's kernel; the reference is cast to match. `float32` expands
    // them to fp32 at load (below).
    let model = LoadedModel::load_as(&gguf, None, ComputeDtype::Auto).unwrap();
    assert_eq!(model.name, "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(model.model.config.num_layers, 30);

    for (text, want) in texts.iter().zip(reference["ids"].as_array().unwrap()) {
        assert_eq!(
            model.tokenizer.encode(text, false).unwrap(),
            ids(want),
            "{text:?}"
        );
    }
    let template = model.template.as_ref().expect("the GGUF's chat template");
    let prompts: Vec<Vec<u32>> = chats
        .iter()
        .zip(reference["prompts"].as_array().unwrap())
        .map(|(chat, want)| {
            let options = text::RenderOptions::default().with_generation_prompt();
            let rendered = template.render(chat.as_array().unwrap(), &options).unwrap();
            let ours = model.tokenizer.encode_chat(&rendered).unwrap();
            assert_eq!(ours, ids(want), "{chat}");
            ours
        })
        .collect();
    let eos = reference["eos"].as_u64().unwrap() as u32;
    assert!(model.stop_tokens.contains(&eos));

    // Greedy tokens of every prompt; full logits (49,152 a step, sent as
    // JSON) for the first prompt's first steps only.
    let oracle = fixtures::reference::run(
        "mlx_lm_oracle.py",
        &serde_json::json!({"model": out.path(), "prompts": prompts, "max_tokens": STEPS, "logits": false, "dtype": COMPUTE}),
    );
    let with_logits = fixtures::reference::run(
        "mlx_lm_oracle.py",
        &serde_json::json!({"model": out.path(), "prompts": [prompts[0]], "max_tokens": LOGIT_STEPS, "dtype": COMPUTE}),
    );
    // The weights as they load under `auto` (packed) and under `float32`
    // on the CPU (expanded to fp32) against the same packed reference.
    let expanded = LoadedModel::load_as(&gguf, None, ComputeDtype::Float32).unwrap();
    for (label, m) in [("packed", &model.model), ("expanded", &expanded.model)] {
        for (prompt, r) in prompts.iter().zip(oracle["results"].as_array().unwrap()) {
            let run = generate::greedy(m, prompt, STEPS, &[], |_| true).unwrap();
            assert_eq!(
                run.tokens,
                ids(&r["tokens"]),
                "{label}: greedy tokens differ from mlx-lm"
            );
        }
        let r = &with_logits["results"][0];
        let want = ids(&r["tokens"]);
        let mut cache = m.new_cache(1);
        let mut logits = prefill(m, &mut cache, &prompts[0], 16).unwrap();
        let mut worst = 0f32;
        for (step, row) in r["logits"].as_array().unwrap().iter().enumerate() {
            let ours: Vec<f32> = logits.reshape(&[-1]).unwrap().as_slice::<f32>().to_vec();
            for (a, b) in ours.iter().zip(row.as_array().unwrap()) {
                worst = worst.max((a - b.as_f64().unwrap() as f32).abs());
            }
            logits = m
                .forward(
                    &generate::tokens_array(&[want[step]]),
                    &mut cache,
                    Logits::Last,
                )
                .unwrap();
        }
        eprintln!("{label}: max |logit - mlx-lm logit| over {LOGIT_STEPS} steps: {worst}");
        assert!(
            worst < LOGIT_TOLERANCE,
            "{label}: logits differ from mlx-lm by {worst}"
        );
    }
    // The factual prompt is answered.
    let answer = ids(&oracle["results"][0]["tokens"]);
    let text = model.tokenizer.decode(&answer, true).unwrap();
    assert!(text.contains("Paris"), "{text:?}");
}
