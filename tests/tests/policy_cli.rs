//! `gateway policy test` and `gateway policy explain`, the built binary on
//! the repository's config.yaml: the example cases (the policies crate docs
//! show them) pass, a wrong expectation fails the run, an unknown signal is
//! refused at its line, and explain's signals and engine for a request are
//! the ones a started gateway reports for it (prompt tokens in `usage`, the
//! engine in `x-engine`), a rule whose engine cannot take the request is
//! shown passed over, as the server passes it over.

use std::process::{Command, Output};

use e2e_tests::build::workspace_root;
use e2e_tests::{binaries, Gateway, DEFAULT_MODEL_NAME, DEFAULT_MODEL_PATH};
use serde_json::json;

fn policy(args: &[&str]) -> Output {
    Command::new(&binaries().gateway)
        .arg("policy")
        .args(args)
        .current_dir(workspace_root())
        .output()
        .expect("run gateway policy")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn the_example_cases_pass_and_mismatches_fail_the_run() {
    let ok = policy(&[
        "test",
        "--config",
        "config.yaml",
        "--cases",
        "policies/examples/config-cases.yaml",
    ]);
    assert!(ok.status.success(), "{}", text(&ok));
    assert!(text(&ok).contains("11 cases, 0 failed"), "{}", text(&ok));

    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("wrong.yaml");
    std::fs::write(
        &wrong,
        "cases:\n  - name: tools\n    signals: { has_tools: true }\n    engine: fastpath\n  - name: alone\n    signals: { greedy: true, engine_accept_rate.lookup: 0.1 }\n    engine: fastpath\n",
    )
    .unwrap();
    let out = policy(&["test", "--cases", wrong.to_str().unwrap()]);
    assert!(!out.status.success(), "{}", text(&out));
    let report = text(&out);
    assert!(
        report.contains(
            "FAIL  tools: routed to lookup (rule `speculate-while-it-pays`), expected fastpath"
        ) && report.contains("ok    alone: fastpath")
            && report.contains("2 cases, 1 failed"),
        "{report}"
    );

    let typo = dir.path().join("typo.yaml");
    std::fs::write(
        &typo,
        "cases:\n  - name: alone\n    signals:\n      greedy: true\n      total_actve: 0\n    engine: fastpath\n",
    )
    .unwrap();
    let out = policy(&["test", "--cases", typo.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("line 5: cases[0].signals: unknown signal `total_actve`"),
        "{}",
        text(&out)
    );
}

#[test]
fn explain_reports_what_the_server_does_with_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let body = json!({"model": DEFAULT_MODEL_NAME, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]});
    let request = dir.path().join("request.json");
    std::fs::write(&request, body.to_string()).unwrap();
    let out = policy(&["explain", "--request", request.to_str().unwrap()]);
    let report = text(&out);
    assert!(out.status.success(), "{report}");
    assert!(
        report.contains("  speculate-while-it-pays  holds  route lookup  <- decides")
            && report.contains("  long-context             -      route batched"),
        "{report}"
    );
    let prompt_tokens: u64 = report
        .lines()
        .find_map(|l| l.strip_prefix("  prompt_tokens: "))
        .expect("prompt_tokens shown")
        .parse()
        .unwrap();

    // The oracle: the same request served by config.yaml.
    let config = std::fs::read_to_string(workspace_root().join("config.yaml")).unwrap();
    let model = fixtures::reference::default_gguf();
    let gw = Gateway::start(&config.replace(
        &format!("path: {DEFAULT_MODEL_PATH}"),
        &format!("path: \"{}\"", model.display()),
    ));
    let r = gw.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["usage"]["prompt_tokens"],
        prompt_tokens,
        "{report}"
    );
    let engine = r.header("x-engine").unwrap().to_owned();
    assert!(
        report.contains(&format!(
            "engine: {engine} (rule `{}`",
            r.header("x-route-rule").unwrap()
        )),
        "{report}"
    );

    // Live load comes from the file: a busy server batches.
    let mut busy = body.clone();
    busy["signals"] = json!({"total_active": 2});
    std::fs::write(&request, busy.to_string()).unwrap();
    let out = policy(&["explain", "--request", request.to_str().unwrap()]);
    assert!(
        text(&out).contains("engine: batched (rule `busy`"),
        "{}",
        text(&out)
    );

    // Tools, drafts rejected lately: the fast path would take a request
    // alone but serves no tools, so the server batches it.
    let mut tools = body.clone();
    tools["tools"] =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let mut explained = tools.clone();
    explained["signals"] = json!({"engine_accept_rate.lookup": 0.1});
    std::fs::write(&request, explained.to_string()).unwrap();
    let out = policy(&["explain", "--request", request.to_str().unwrap()]);
    let report = text(&out);
    assert!(
        report.contains("  alone                    holds  route fastpath  <- passed over: fastpath: it does not serve requests with tools")
            && report.contains("engine: batched (rule `default`"),
        "{report}"
    );
    let r = gw.post("/v1/chat/completions", &tools);
    assert_eq!(r.status, 200, "{}", r.text());
    // Prompt lookup while its drafts pay (the first request measured them),
    // else the fast path is passed over as explain shows.
    let route = (
        r.header("x-engine").unwrap(),
        r.header("x-route-rule").unwrap(),
    );
    assert!(
        [
            ("lookup", "speculate-while-it-pays"),
            ("batched", "default")
        ]
        .contains(&route),
        "{route:?}"
    );
}
