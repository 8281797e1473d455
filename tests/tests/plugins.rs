//! The plugin host: plugins load by path and from the build's plugin
//! directory, a plugin built against another MLX (or a garbage
//! file) is refused by name while the gateway serves with the rest, plugin
//! log lines reach the host's log, the weights are in memory once however
//! many engines share them, a plugin built apart (its own cargo
//! invocation, lock file and target directory) loads, serves and shares
//! them too, the remote plugin, which runs no model, links no MLX, and a
//! plugin's request waiting for KV blocks another engine holds starts when
//! they come back and ends the moment it is cancelled, and a repeated
//! prompt starts from the prefix cache in the plugins as in the built-in
//! engines.

use std::time::{Duration, Instant};

use e2e_tests::build::template_plugin;
use e2e_tests::http::SseStream;
use e2e_tests::{binaries, models, Gateway, MODEL};
use fixtures::model::TinySpec;
use runtime::Family;
use serde_json::{json, Value};

fn chat(gw: &Gateway) -> e2e_tests::Response {
    gw.post(
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    )
}

#[test]
fn mismatched_plugin_is_refused_and_the_gateway_serves_with_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("libengine_garbage.so");
    std::fs::write(&garbage, b"\x7fELF but not really a shared object").unwrap();
    // A real plugin cut short, as a failed copy or a bad strip leaves it.
    let truncated = dir.path().join("libengine_truncated.so");
    let real = std::fs::read(&binaries().reference_plugin).unwrap();
    std::fs::write(&truncated, &real[..real.len().min(4096)]).unwrap();
    let config = r#"model: { path: "{model}", kv_cache_mb: 64 }
plugins: ["{reference}", "{mismatch}", "GARBAGE", "TRUNCATED"]
engines:
  ref: { kind: reference }
  old: { kind: mismatch }
  gone: { kind: not-built-anywhere }
policy:
  default: ref
"#
    .replace("GARBAGE", &garbage.display().to_string())
    .replace("TRUNCATED", &truncated.display().to_string());
    let gw = Gateway::start(&config);
    // Still serving.
    let r = chat(&gw);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-engine"), Some("ref"));

    // Not ready: two configured engines did not load; the body says why.
    let h = gw.get("/health");
    assert_eq!(h.status, 503);
    let v = h.json();
    assert_eq!(v["status"], "degraded");
    let engines = v["engines"].as_array().unwrap();
    let by_name = |n: &str| {
        engines
            .iter()
            .find(|e| e["name"] == n)
            .unwrap_or_else(|| panic!("{n} missing: {v}"))
    };
    assert_eq!(by_name("ref")["status"], "ready");
    assert_eq!(by_name("old")["status"], "failed");
    assert!(
        by_name("gone")["error"]
            .as_str()
            .unwrap()
            .contains("libengine_not_built_anywhere"),
        "{v}"
    );
    let refused = v["refused_plugins"].as_array().unwrap();
    assert_eq!(refused.len(), 3, "{v}");
    let refusal = |file: &str| {
        let r = refused
            .iter()
            .find(|r| r["path"].as_str().unwrap().ends_with(file))
            .unwrap_or_else(|| panic!("{file} not refused: {v}"));
        r["error"].as_str().unwrap().to_owned()
    };
    // Both values of the mismatched fingerprint are named, with what to
    // rebuild.
    let mismatch = refusal("libengine_mismatch.so");
    for needle in [
        "built against `mlx 0.0.0-mismatch",
        &format!("gateway has `{}`", runtime::abi::mlx_fingerprint()),
        "rebuild the plugin with this gateway's MLX",
    ] {
        assert!(mismatch.contains(needle), "{needle:?} not in {mismatch}");
    }
    for file in ["libengine_garbage.so", "libengine_truncated.so"] {
        let e = refusal(file);
        assert!(
            e.contains("cannot load plugin") && e.contains("rebuild"),
            "{e}"
        );
    }
    assert!(
        gw.logged("plugin refused") && gw.logged("0.0.0-mismatch"),
        "{}",
        gw.logs()
    );
    assert_eq!(gw.metric("gateway_engines_failed", &[]), Some(2.0));
}

#[test]
fn plugin_log_lines_reach_the_host_log() {
    let gw = Gateway::start(&e2e_tests::basic_config(""));
    gw.logged("reference engine ready");
    let logs = gw.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("reference engine ready"))
        .unwrap_or_else(|| panic!("the plugin's log line is missing:\n{logs}"));
    // Emitted by the plugin's own code (its module path), through the host.
    assert!(
        line.contains("engine_reference") && line.contains("engine=ref"),
        "{line}"
    );
}

#[test]
fn engines_load_from_the_build_plugin_directory_by_default() {
    // No `plugins:` list: `kind: reference` is found as libengine_reference
    // next to the gateway executable.
    let bins = binaries();
    assert!(bins
        .dir
        .join(bins.reference_plugin.file_name().unwrap())
        .is_file());
    let config = r#"model: { path: "{model}", kv_cache_mb: 64 }
engines:
  ref: { kind: reference }
policy: { default: ref }
"#;
    let gw = Gateway::start(config);
    assert_eq!(gw.get("/health").status, 200);
    assert_eq!(chat(&gw).status, 200);
}

#[test]
fn the_remote_plugin_links_no_mlx() {
    // It runs no model: the served model's name and tokenizer come in its
    // context, so libmlx is not among the libraries it needs, as it is
    // for an engine that runs the model.
    let needs_mlx = |kind: &str| {
        let file = binaries().dir.join(format!("libengine_{kind}.so"));
        let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        bytes.windows(9).any(|w| w == b"libmlx.so")
    };
    assert!(needs_mlx("batched"));
    assert!(!needs_mlx("remote"));
}

/// A model big enough for resident memory to show a copy of its weights:
/// about 84 MB of float32. Returns the model and its weight bytes.
fn rss_model() -> (models::ModelDir, u64) {
    let spec = TinySpec {
        hidden: 512,
        layers: 6,
        heads: 8,
        kv_heads: 4,
        head_dim: 64,
        intermediate: 1536,
        vocab: 4096,
        ..TinySpec::tiny(Family::Qwen3)
    };
    (
        models::write("rss-qwen3", &spec),
        spec.parameters() as u64 * 4,
    )
}

#[test]
fn weights_are_in_memory_once_however_many_engines_share_them() {
    let (model, weights) = rss_model();
    let config = |engines: usize| {
        let mut c = format!(
            "model: {{ path: \"{}\", kv_cache_mb: 64 }}\nplugins: [\"{{reference}}\"]\nengines:\n",
            model.path.display()
        );
        for i in 0..engines {
            c.push_str(&format!("  e{i}: {{ kind: reference }}\n"));
        }
        c.push_str("policy: { default: e0 }\n");
        c
    };
    let rss = |engines: usize| {
        let gw = Gateway::start(&config(engines));
        let r = gw.post(
            "/v1/chat/completions",
            &json!({"model": "rss-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            gw.get("/health").json()["engines"]
                .as_array()
                .unwrap()
                .len(),
            engines
        );
        gw.rss_bytes()
    };
    let one = rss(1);
    let four = rss(4);
    let mb = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "weights {:.1} MB; RSS with 1 engine {:.1} MB, with 4 engines {:.1} MB",
        mb(weights),
        mb(one),
        mb(four)
    );
    assert!(
        one > weights,
        "the weights should be resident: RSS {one} < weights {weights}"
    );
    // Copies per engine would add 3 x weights.
    assert!(
        four < one + weights / 4,
        "4 engines use {:.1} MB more than 1",
        mb(four.saturating_sub(one))
    );
}

#[test]
fn a_plugin_built_apart_serves_and_shares_the_weights() {
    let (template, build_time) = template_plugin();
    eprintln!(
        "template plugin: {} (built in {:.1} s)",
        template.display(),
        build_time.as_secs_f64()
    );
    let (model, weights) = rss_model();
    let config = |engines: &str, default: &str| {
        format!(
            "model: {{ path: \"{}\", kv_cache_mb: 64 }}\nplugins: [\"{{reference}}\", \"{}\"]\nengines:\n{engines}policy: {{ default: {default} }}\n",
            model.path.display(),
            template.display()
        )
    };
    let greedy = json!({
        "model": "rss-qwen3",
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": 8,
        "temperature": 0
    });
    // The reference engine alone: its greedy text and resident memory.
    let (reference_text, one) = {
        let gw = Gateway::start(&config("  ref: { kind: reference }\n", "ref"));
        let r = gw.post("/v1/chat/completions", &greedy);
        assert_eq!(r.status, 200, "{}", r.text());
        (
            r.json()["choices"][0]["message"]["content"].clone(),
            gw.rss_bytes(),
        )
    };
    // With the plugin built apart beside it, serving by default.
    let gw = Gateway::start(&config(
        "  ref: { kind: reference }\n  tmpl: { kind: template }\n",
        "tmpl",
    ));
    let h = gw.get("/health");
    assert_eq!(h.status, 200, "{}", h.text());
    let r = gw.post("/v1/chat/completions", &greedy);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-engine"), Some("tmpl"));
    let v = r.json();
    // The same weights give the same greedy text as the in-tree engine.
    assert_eq!(v["choices"][0]["message"]["content"], reference_text, "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{v}");
    // Streaming works across the boundary too.
    let mut stream_req = greedy.clone();
    stream_req["stream"] = json!(true);
    let s = gw.post("/v1/chat/completions", &stream_req);
    assert_eq!(s.status, 200, "{}", s.text());
    assert!(s.text().contains("data: [DONE]"), "{}", s.text());
    // Its log lines reach the host's log through the boundary.
    assert!(
        gw.logged("template engine ready") && gw.logged("engine=tmpl"),
        "{}",
        gw.logs()
    );
    let two = gw.rss_bytes();
    let mb = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "weights {:.1} MB; RSS with the reference engine {:.1} MB, with the template plugin beside it {:.1} MB",
        mb(weights),
        mb(one),
        mb(two)
    );
    // A copy of the weights would add all of them.
    assert!(
        two < one + weights / 4,
        "the plugin built apart adds {:.1} MB",
        mb(two.saturating_sub(one))
    );
}

/// Two reference engines over one small pool: `slow` streams requests
/// with long prompts, `queued` takes the rest. Until its first token a request
/// has a second (`request_timeout_s`), then it is cancelled.
const SMALL_POOL: &str = r#"model: { path: "{model}", kv_cache_mb: 8 }
server: { request_timeout_s: 1 }
plugins: ["{reference}"]
engines:
  slow: { kind: reference, token_delay_ms: 20 }
  queued: { kind: reference }
policy:
  default: queued
  rules:
    - name: long-to-slow
      when: { prompt_tokens: { gt: 16 } }
      route: slow
"#;

fn completion(max_tokens: u64, long_prompt: bool, stream: bool) -> Value {
    let prompt = if long_prompt {
        "hello there ".repeat(20)
    } else {
        "hello there".into()
    };
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": true, "stream": stream})
}

#[test]
fn a_request_waiting_for_kv_blocks_starts_when_they_come_back_and_ends_when_cancelled() {
    let gw = Gateway::start(SMALL_POOL);
    let pool = |gw: &Gateway, field: &str| gw.health()["kv_pool"][field].as_u64().unwrap();
    // Each of the two large requests holds over half of the pool.
    let large = pool(&gw, "total_blocks") * 16 * 6 / 10;
    let mut holder = SseStream::open(gw.addr, "/v1/completions", &completion(large, true, true));
    assert_eq!(holder.status, 200);
    assert!(holder.next_event().is_some());
    let held = pool(&gw, "allocated_blocks");

    // One that cannot fit beside it waits, and its timeout cancels it.
    let r = gw.post("/v1/completions", &completion(large, false, false));
    assert_eq!(r.status, 504, "{}", r.text());
    // Its engine lets it go at once, while the holder still runs (were it
    // still waiting, it would hold its engine until the holder ends).
    let idle = |gw: &Gateway| {
        let engines = gw.health()["engines"].as_array().unwrap().clone();
        let queued = engines.iter().find(|e| e["name"] == "queued").unwrap();
        queued["active"] == 0 && queued["queued"] == 0
    };
    assert!(
        gw.wait_for(Duration::from_millis(500), idle),
        "{}",
        gw.health()
    );
    assert!(holder.next_event().is_some(), "the holder still streams");
    assert_eq!(pool(&gw, "allocated_blocks"), held);

    // Another waits; the holder's client leaves, its blocks come back
    // (from the host's pool to the waiting plugin) and it starts within
    // its second.
    let waiting = std::thread::spawn({
        let addr = gw.addr;
        move || SseStream::open(addr, "/v1/completions", &completion(large, false, true))
    });
    std::thread::sleep(Duration::from_millis(300));
    let released = Instant::now();
    holder.disconnect();
    let mut started = waiting.join().unwrap();
    assert_eq!(started.status, 200);
    assert!(started.next_event().is_some());
    assert!(released.elapsed() < Duration::from_secs(1));
    started.disconnect();
    assert!(
        gw.wait_for(Duration::from_secs(5), |gw| pool(gw, "allocated_blocks")
            == 0),
        "{}",
        gw.health()
    );
}

/// The template (built apart) and the reference plugin start a prompt from
/// the shared prefix cache's longest hit, through the runtime's
/// `Sequence`: the same prompt again has every whole block of it but the
/// last token's counted as cached, and the same text as the first time.
/// The reference plugin's sampled path (seeded, with logprobs) too.
#[test]
fn a_repeated_prompt_starts_from_the_prefix_cache_in_the_plugins() {
    let (template, _) = template_plugin();
    let gw = Gateway::start(&format!(
        r#"model: {{ path: "{{model}}", kv_cache_mb: 64, prefix_cache_entries: 16 }}
plugins: ["{{reference}}", "{}"]
engines:
  ref: {{ kind: reference }}
  tmpl: {{ kind: template }}
policy:
  default: ref
  rules:
    - {{ name: short, when: {{ max_tokens: 12 }}, route: tmpl }}
"#,
        template.display()
    ));
    let block = gw.health()["kv_pool"]["block_size"].as_u64().unwrap();
    let greedy = |max_tokens: u64, words: &str| {
        json!({"model": MODEL, "prompt": words.repeat(12), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": true})
    };
    let mut sampled = greedy(16, "sampled words ");
    sampled["temperature"] = json!(0.9);
    sampled["seed"] = json!(7);
    sampled["logprobs"] = json!(2);
    for (engine, body) in [
        ("tmpl", greedy(12, "template words ")),
        ("ref", greedy(16, "reference words ")),
        ("ref", sampled),
    ] {
        let [first, again] = [0, 1].map(|_| {
            let r = gw.post("/v1/completions", &body);
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(r.header("x-engine"), Some(engine), "{body}");
            r.json()
        });
        let usage = &again["usage"];
        let prompt = usage["prompt_tokens"].as_u64().unwrap();
        assert!(prompt > block, "{usage}");
        assert_eq!(
            usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
            Some((prompt - 1) / block * block),
            "{engine}: {body}: {usage}"
        );
        assert_eq!(
            first["choices"][0]["text"], again["choices"][0]["text"],
            "{engine}: {body}"
        );
        assert_eq!(
            first["usage"]["completion_tokens"],
            usage["completion_tokens"]
        );
    }
}
