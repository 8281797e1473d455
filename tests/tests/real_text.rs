//! The default model (SmolLM2-135M-Instruct, the GGUF scripts/setup
//! fetches) behind the gateway with every local engine, on chat prompts:
//! each engine's greedy answer is mlx-lm's on the same weights (read by
//! MLX's own GGUF loader, scripts/gguf_reference.py), streamed or not; the
//! factual prompt is answered; stop strings, logprobs and the tool-call
//! parser work on real output; a multi-turn tool conversation renders on a
//! template that concatenates `message['content']`.

use std::path::Path;

use e2e_tests::http::json_chunks;
use e2e_tests::Gateway;
use serde_json::{json, Value};

/// `max_tokens` picks the engine; the reference decodes `STEPS` tokens.
const CONFIG: &str = r#"model: { path: "{gguf}", name: smollm2, kv_cache_mb: 256 }
engines:
  batched: { kind: batched }
  fastpath: { kind: fastpath }
  dflash: { kind: dflash, draft: ngram }
  mtp: { kind: mtp, draft: ngram }
policy:
  default: batched
  rules:
    - { name: to-fastpath, when: { max_tokens: 21 }, route: fastpath }
    - { name: to-dflash, when: { max_tokens: 22 }, route: dflash }
    - { name: to-mtp, when: { max_tokens: 23 }, route: mtp }
"#;
const ENGINES: [(&str, u32); 4] = [
    ("batched", 20),
    ("fastpath", 21),
    ("dflash", 22),
    ("mtp", 23),
];
// Long enough for the tool chat's whole JSON call (the model writes it
// pretty-printed in fp32).
const STEPS: usize = 32;
const LOGPROB_STEPS: usize = 8;

fn tool_prompt() -> Value {
    json!([{"role": "user", "content":
        "Reply with a JSON object {\"name\": \"get_weather\", \"parameters\": {\"city\": ...}} for the city Berlin."}])
}

fn weather_tool() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
}

/// A finished tool round as OpenAI clients send it: the assistant turn has
/// `content: null` and `tool_calls`, the result comes as `role: tool`.
fn tool_conversation(content: Value) -> Value {
    json!([
        {"role": "user", "content": "What's the weather in Berlin?"},
        {"role": "assistant", "content": content, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Berlin\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
    ])
}

struct Reference {
    tokenizer: text::Tokenizer,
    stops: Vec<u32>,
    /// Per chat: greedy tokens.
    runs: Vec<Vec<u32>>,
    /// The first chat's logits for its first `LOGPROB_STEPS` steps.
    logits: Vec<Vec<f32>>,
    /// Prompt length of the tool conversation (content rendered as "").
    tool_round_prompt: usize,
    _dir: tempfile::TempDir,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// The gateway computes in fp32 on the CPU (`model.compute_dtype: auto`), so
/// the reference does too.
const COMPUTE: &str = "float32";

fn reference(gguf: &Path, chats: &[Value]) -> Reference {
    let dir = tempfile::tempdir().unwrap();
    let mut all = chats.to_vec();
    all.push(tool_conversation(json!("")));
    let conv = fixtures::reference::run(
        "gguf_reference.py",
        &json!({"gguf": gguf, "out": dir.path(), "chats": all}),
    );
    let mut prompts: Vec<Vec<u32>> = conv["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect();
    let tool_round_prompt = prompts.pop().unwrap().len();
    let out = fixtures::reference::run(
        "mlx_lm_oracle.py",
        &json!({"model": dir.path(), "prompts": prompts, "max_tokens": STEPS, "logits": false, "dtype": COMPUTE}),
    );
    let runs = out["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| ids(&r["tokens"]))
        .collect();
    let first = fixtures::reference::run(
        "mlx_lm_oracle.py",
        &json!({"model": dir.path(), "prompts": [prompts[0]], "max_tokens": LOGPROB_STEPS, "dtype": COMPUTE}),
    );
    let logits = first["results"][0]["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    // The tokenizer transformers converted from the same file.
    let tokenizer = text::Tokenizer::from_dir(dir.path()).unwrap();
    let stops = text::eos::eos_token_ids(dir.path(), &tokenizer).unwrap();
    Reference {
        tokenizer,
        stops,
        runs,
        logits,
        tool_round_prompt,
        _dir: dir,
    }
}

impl Reference {
    /// The answer a chat request with `max_tokens` gets: the greedy tokens
    /// up to the first stop token, and the finish reason.
    fn answer(&self, chat: usize, max_tokens: usize) -> (String, &'static str) {
        let tokens = &self.runs[chat][..max_tokens];
        let (kept, reason) = match tokens.iter().position(|t| self.stops.contains(t)) {
            Some(end) => (&tokens[..end], "stop"),
            None => (tokens, "length"),
        };
        (self.tokenizer.decode(kept, true).unwrap(), reason)
    }
}

fn chat(gw: &Gateway, messages: &Value, extra: Value) -> (Value, String) {
    let mut body = json!({"model": "smollm2", "messages": messages, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    // Engines free their slot before the final event: the next request,
    // sent right after the last byte, finds them free (no retry on 503).
    let r = gw.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let engine = r.header("x-engine").unwrap_or_default().to_owned();
    if body["stream"] == json!(true) {
        let chunks = json_chunks(&r.sse_data());
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        let reason = chunks
            .iter()
            .find_map(|c| c["choices"][0]["finish_reason"].as_str().map(str::to_owned))
            .unwrap();
        (json!({"content": text, "finish_reason": reason}), engine)
    } else {
        let v = r.json();
        let choice = &v["choices"][0];
        let mut out = choice["message"].clone();
        out["finish_reason"] = choice["finish_reason"].clone();
        out["logprobs"] = choice["logprobs"].clone();
        (out, engine)
    }
}

/// One reference run and one gateway for both checks (the conversion and
/// the model load are the slow part).
#[test]
fn real_text_through_every_engine() {
    let gguf = fixtures::reference::default_gguf();
    let mut chats = fixtures::reference::chat_prompts();
    chats.push(tool_prompt());
    let reference = reference(&gguf, &chats);
    let gw = Gateway::start(&CONFIG.replace("{gguf}", &gguf.display().to_string()));
    every_engine_answers_like_mlx_lm(&gw, &reference, &chats);
    logprobs_tool_calls_and_tool_rounds(&gw, &reference, &chats);
}

fn every_engine_answers_like_mlx_lm(gw: &Gateway, reference: &Reference, chats: &[Value]) {
    for (engine, max_tokens) in ENGINES {
        for (i, messages) in chats.iter().enumerate() {
            let (want, reason) = reference.answer(i, max_tokens as usize);
            for stream in [false, true] {
                let (got, served_by) = chat(
                    gw,
                    messages,
                    json!({"max_tokens": max_tokens, "stream": stream}),
                );
                assert_eq!(served_by, engine);
                assert_eq!(
                    got["content"],
                    json!(want),
                    "{engine} stream={stream} chat {i}"
                );
                assert_eq!(
                    got["finish_reason"],
                    json!(reason),
                    "{engine} stream={stream} chat {i}"
                );
            }
        }
        // A factual question is answered.
        let (got, _) = chat(gw, &chats[0], json!({"max_tokens": max_tokens}));
        assert!(
            got["content"].as_str().unwrap().contains("Paris"),
            "{engine}: {got}"
        );
        // A stop string cuts the real answer before it, streamed or not.
        let (full, _) = reference.answer(0, max_tokens as usize);
        let before = &full[..full.find(" Paris").expect("the reference names Paris")];
        for stream in [false, true] {
            let (got, _) = chat(
                gw,
                &chats[0],
                json!({"max_tokens": max_tokens, "stop": [" Paris"], "stream": stream}),
            );
            assert_eq!(got["content"], json!(before), "{engine} stream={stream}");
            assert_eq!(got["finish_reason"], json!("stop"));
        }
    }
}

fn logprobs_tool_calls_and_tool_rounds(gw: &Gateway, reference: &Reference, chats: &[Value]) {
    let tool_chat = chats.len() - 1;

    // Logprobs of the real answer are the reference's log-softmax.
    let (got, _) = chat(
        gw,
        &chats[0],
        json!({"max_tokens": LOGPROB_STEPS, "logprobs": true, "top_logprobs": 2}),
    );
    let (tokens, logits) = (&reference.runs[0], &reference.logits);
    let content = got["logprobs"]["content"].as_array().unwrap();
    assert!(!content.is_empty());
    for (step, entry) in content.iter().enumerate() {
        let row = &logits[step];
        let max = row.iter().copied().fold(f32::MIN, f32::max);
        let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
        let want = row[tokens[step] as usize] - lse;
        let lp = entry["logprob"].as_f64().unwrap() as f32;
        assert!(
            (lp - want).abs() < 0.05,
            "step {step}: logprob {lp} vs reference {want}"
        );
        assert_eq!(
            entry["top_logprobs"][0]["token"], entry["token"],
            "greedy picks the top token"
        );
    }

    // The tool-call parser on what the model really writes for a tool
    // request (Llama-family JSON calls): the reference text parses to a call.
    let (text, _) = reference.answer(tool_chat, STEPS);
    let (_, calls) = text::tools::parse_complete(text::tools::ToolFormat::Llama3Json, &text);
    assert_eq!(
        calls.len(),
        1,
        "the reference answer {text:?} is a tool call"
    );
    let (got, _) = chat(
        gw,
        &chats[tool_chat],
        json!({"max_tokens": STEPS, "tools": weather_tool()}),
    );
    let call = &got["tool_calls"][0]["function"];
    assert_eq!(call["name"], json!("get_weather"), "{got}");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Berlin"}));
    assert_eq!(got["finish_reason"], json!("tool_calls"));

    // The client sends the round back: null content next to tool_calls and
    // a tool message render as vLLM renders them, as the prompt length shows.
    let r = gw.post(
        "/v1/chat/completions",
        &json!({"model": "smollm2", "messages": tool_conversation(Value::Null), "max_tokens": 16,
                "temperature": 0, "tools": weather_tool()}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["usage"]["prompt_tokens"],
        json!(reference.tool_round_prompt)
    );
}

/// A truncated download of the default model stops the gateway at start
/// with an error naming the file and what is missing, not a crash.
#[test]
fn truncated_gguf_fails_at_start_naming_the_file() {
    let gguf = fixtures::reference::default_gguf();
    let dir = tempfile::tempdir().unwrap();
    let cut = dir.path().join("cut.gguf");
    let bytes = std::fs::read(&gguf).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let config = CONFIG.replace("{gguf}", &cut.display().to_string());
    let err = match Gateway::try_start(&config, &[]) {
        Ok(_) => panic!("a truncated GGUF must not serve"),
        Err(e) => e,
    };
    assert!(
        err.status
            .is_some_and(|s| !s.success() && s.code().is_some()),
        "{:?}",
        err.status
    );
    assert!(
        err.logs.contains("cut.gguf") && err.logs.contains("runs past the end of the file"),
        "{}",
        err.logs
    );
}
