//! The `bench` binary against the real gateway (config.yaml's engines and
//! policy, the tiny model): a short sweep writes a result file with every
//! field, sane numbers and an SVG, and `bench plot` compares result files.

use std::path::Path;
use std::process::Command;

use e2e_tests::build::binaries;
use e2e_tests::Gateway;
use serde_json::Value;

fn start() -> Gateway {
    Gateway::start(&e2e_tests::default_config_on_tiny_model())
}

fn bench(args: &[&str]) -> String {
    let out = Command::new(&binaries().bench)
        .args(args)
        .output()
        .expect("run bench");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "bench {args:?} failed:\n{text}");
    text
}

fn read(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("result file")).expect("JSON")
}

fn assert_summary(level: &Value, field: &str) {
    let s = &level[field];
    for key in ["count", "mean", "min", "p50", "p90", "p99", "max"] {
        assert!(s[key].is_number(), "{field}.{key} in {level}");
    }
    let v = |k: &str| s[k].as_f64().unwrap();
    assert!(
        v("min") <= v("p50")
            && v("p50") <= v("p90")
            && v("p90") <= v("p99")
            && v("p99") <= v("max"),
        "{field} out of order: {s}"
    );
    assert!(v("min") >= 0.0, "{field}: {s}");
}

#[test]
fn short_sweep_writes_results_and_plots() {
    let gw = start();
    let dir = tempfile::tempdir().unwrap();
    let (json, svg) = (dir.path().join("ours.json"), dir.path().join("ours.svg"));
    let url = format!("http://{}", gw.addr);
    let log = bench(&[
        "run",
        "--url",
        &url,
        "--label",
        "ours",
        "--concurrency",
        "1,2",
        "--requests",
        "3",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--ignore-eos",
        "--warmup",
        "1",
        "--out",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(log.contains("c=2"), "{log}");

    let r = read(&json);
    assert_eq!(r["schema"], "gateway-bench/1");
    assert_eq!(r["label"], "ours");
    assert_eq!(r["settings"]["endpoint"], "completions");
    assert_eq!(r["settings"]["model"], e2e_tests::MODEL);
    let levels = r["levels"].as_array().unwrap();
    assert_eq!(levels.len(), 2);
    for (level, c) in levels.iter().zip([1, 2]) {
        assert_eq!(level["concurrency"], c);
        assert_eq!(level["requests"], 3, "{level}");
        assert_eq!(level["completed"], 3, "{level}");
        assert_eq!(level["errors"], 0, "{level}");
        // ignore_eos: every request generates exactly max_tokens.
        assert_eq!(level["output_tokens"], 24, "{level}");
        assert!(
            level["prompt_tokens"].as_u64().unwrap() >= 3 * 12,
            "{level}"
        );
        for field in ["duration_s", "requests_per_s", "output_tok_s"] {
            assert!(level[field].as_f64().unwrap() > 0.0, "{field}: {level}");
        }
        for field in [
            "ttft_ms",
            "itl_ms",
            "tpot_ms",
            "e2e_ms",
            "request_output_tok_s",
        ] {
            assert_summary(level, field);
        }
        assert_eq!(level["ttft_ms"]["count"], 3);
        let engines: u64 = level["engines"]
            .as_object()
            .unwrap()
            .values()
            .map(|n| n.as_u64().unwrap())
            .sum();
        assert_eq!(engines, 3, "every response names its engine: {level}");
    }
    // Alone: the default policy's prompt lookup while its drafts are
    // accepted, else (greedy) the fast path.
    let alone = &levels[0]["engines"];
    let served = |e: &str| alone[e].as_u64().unwrap_or(0);
    assert_eq!(served("lookup") + served("fastpath"), 3, "{}", levels[0]);
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.contains("Output tok/s"));

    // The bundled mixed prompts over chat, tools included.
    let mixed = dir.path().join("mixed.json");
    bench(&[
        "run",
        "--url",
        &url,
        "--label",
        "mixed",
        "--prompts",
        "mixed",
        "--concurrency",
        "2",
        "--requests",
        "5",
        "--output-len",
        "4",
        "--warmup",
        "0",
        "--out",
        mixed.to_str().unwrap(),
    ]);
    let m = read(&mixed);
    assert_eq!(m["settings"]["endpoint"], "chat");
    assert_eq!(m["levels"][0]["completed"], 5, "{m}");

    let compared = dir.path().join("compare.svg");
    let tables = bench(&[
        "plot",
        json.to_str().unwrap(),
        mixed.to_str().unwrap(),
        "--out",
        compared.to_str().unwrap(),
        "--ratio",
        "ours/mixed",
    ]);
    assert!(
        tables.contains("| c | ours | mixed | ours / mixed |"),
        "{tables}"
    );
    assert!(tables.contains("TTFT p50 (ms)"), "{tables}");
    assert!(std::fs::read_to_string(&compared)
        .unwrap()
        .contains("mixed"));
}
