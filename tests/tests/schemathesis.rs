//! schemathesis (PyPI, installed by scripts/setup) fuzzes the live API from
//! its own `/openapi.json`: valid and invalid inputs for every operation,
//! coverage, fuzzing and stateful phases. The one check: no response is a
//! 5xx. The server runs the repository's config.yaml (real engines) over a
//! generated model with a small context window, so any max_tokens the
//! fuzzer picks finishes quickly. `SCHEMATHESIS_EXAMPLES` sets the examples
//! per operation (default 40).

use std::process::Command;

use e2e_tests::build::workspace_root;
use e2e_tests::{models, Gateway};
use fixtures::model::TinySpec;
use runtime::Family;

#[test]
fn no_generated_input_gets_a_server_error() {
    let model = models::write(
        "tiny-qwen3",
        &TinySpec {
            context: 192,
            ..TinySpec::tiny(Family::Qwen3)
        },
    );
    let config =
        std::fs::read_to_string(workspace_root().join("config.yaml")).expect("config.yaml");
    let config = e2e_tests::with_model(&config, &model.path);
    let gw = Gateway::start(&config);
    let st = fixtures::reference::venv_bin("st");
    let examples = std::env::var("SCHEMATHESIS_EXAMPLES").unwrap_or_else(|_| "40".into());
    let out = Command::new(&st)
        .args(["run", &format!("http://{}/openapi.json", gw.addr)])
        .args(["--checks", "not_a_server_error"])
        .args(["--max-examples", &examples])
        .args(["--generation-deterministic", "--no-color"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} ({e}); run scripts/setup", st.display()));
    let report = String::from_utf8_lossy(&out.stdout);
    println!("{report}");
    assert!(
        out.status.success(),
        "schemathesis found failures:\n{report}\n{}\n--- gateway log\n{}",
        String::from_utf8_lossy(&out.stderr),
        gw.logs()
    );
    // Every operation was exercised.
    assert!(report.contains("Tested: 8"), "{report}");
}
