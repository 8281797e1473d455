//! The plugin host: plugins load by path and from the build's plugin
//! directory, a plugin built against other versions is refused by name
//! while the gateway serves with the rest, plugin log lines reach the
//! host's log, and the weights are in memory once however many engines
//! share them.

use e2e_tests::{binaries, models, Gateway, MODEL};
use fixtures::model::TinySpec;
use runtime::Family;
use serde_json::json;

fn chat(gw: &Gateway) -> e2e_tests::Response {
    gw.post(
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    )
}

#[test]
fn mismatched_plugin_is_refused_and_the_gateway_serves_with_the_rest() {
    let config = r#"model: { path: "{model}", kv_cache_mb: 64 }
plugins: ["{reference}", "{mismatch}"]
engines:
  ref: { kind: reference }
  old: { kind: mismatch }
  gone: { kind: not-built-anywhere }
policy:
  default: ref
"#;
    let gw = Gateway::start(config);
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
    let refused = v["refused_plugins"][0]["error"].as_str().unwrap();
    // Both versions of each mismatched field are named.
    let host_core = env!("CARGO_PKG_VERSION");
    let abi = engine_core::plugin::PLUGIN_ABI_VERSION;
    for needle in [
        &format!("plugin ABI version {}", abi + 1000),
        &format!("gateway has {abi})"),
        "0.0.0-mismatch",
        &format!("gateway has {host_core}"),
    ] {
        assert!(refused.contains(needle), "{needle:?} not in {refused}");
    }
    assert!(v["refused_plugins"][0]["path"]
        .as_str()
        .unwrap()
        .ends_with("libengine_mismatch.so"));
    let logs = gw.logs();
    assert!(
        logs.contains("plugin refused") && logs.contains("0.0.0-mismatch"),
        "{logs}"
    );
    assert_eq!(gw.metric("gateway_engines_failed", &[]), Some(2.0));
}

#[test]
fn plugin_log_lines_reach_the_host_log() {
    let gw = Gateway::start(&e2e_tests::basic_config(""));
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
fn weights_are_in_memory_once_however_many_engines_share_them() {
    // About 84 MB of float32 weights.
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
    let weights = spec.parameters() as u64 * 4;
    let model = models::write("rss-qwen3", &spec);
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
