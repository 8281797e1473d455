//! Hot reload: a good file replaces the policy, a bad one never does.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use policies::{PolicyError, PolicyHandle, Signals};

const ENGINES: &[&str] = &["batched", "fastpath", "dflash"];

/// A whole gateway config whose policy routes greedy requests to `greedy_to`.
fn config(greedy_to: &str) -> String {
    format!(
        "model: qwen3\nserver: {{ port: 8080 }}\npolicy:\n  default: batched\n  rules:\n    \
         - {{ name: greedy-to-{greedy_to}, when: {{ greedy: true }}, route: {greedy_to} }}\n"
    )
}

fn greedy_engine(handle: &PolicyHandle) -> String {
    let policy = handle.current();
    policy
        .decide(&Signals {
            greedy: true,
            ..Signals::default()
        })
        .engine
        .to_owned()
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

#[test]
fn reload_keeps_old_policy_on_bad_file_and_takes_a_good_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    write(&path, &config("fastpath"));
    let handle = PolicyHandle::from_file(&path, ENGINES).unwrap();
    assert_eq!(greedy_engine(&handle), "fastpath");

    // Unknown engine, malformed YAML, missing section, missing file: all kept.
    write(&path, &config("mtp"));
    let e = handle.reload_from_file(&path).unwrap_err();
    assert!(e.to_string().contains("engine `mtp` is not loaded"), "{e}");
    write(&path, "policy: [");
    assert!(matches!(
        handle.reload_from_file(&path),
        Err(PolicyError::Yaml(_))
    ));
    write(&path, "model: qwen3\n");
    assert!(matches!(
        handle.reload_from_file(&path),
        Err(PolicyError::MissingPolicy)
    ));
    let missing = dir.path().join("gone.yaml");
    let e = handle.reload_from_file(&missing).unwrap_err();
    assert!(matches!(e, PolicyError::Io { .. }));
    assert!(
        e.to_string()
            .starts_with(&format!("cannot read policy file {}", missing.display())),
        "{e}"
    );
    assert_eq!(greedy_engine(&handle), "fastpath");

    write(&path, &config("dflash"));
    handle.reload_from_file(&path).unwrap();
    assert_eq!(greedy_engine(&handle), "dflash");
    // Clones share the policy.
    assert_eq!(greedy_engine(&handle.clone()), "dflash");
}

#[test]
fn a_policy_held_across_a_reload_is_unaffected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    write(&path, &config("fastpath"));
    let handle = PolicyHandle::from_file(&path, ENGINES).unwrap();
    let held = handle.current();
    write(&path, &config("dflash"));
    handle.reload_from_file(&path).unwrap();
    assert_eq!(
        held.decide(&Signals {
            greedy: true,
            ..Signals::default()
        })
        .engine,
        "fastpath"
    );
    assert_eq!(greedy_engine(&handle), "dflash");
}

#[test]
fn initial_load_fails_loudly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    write(&path, &config("mtp"));
    assert!(matches!(
        PolicyHandle::from_file(&path, ENGINES),
        Err(PolicyError::UnknownEngine { .. })
    ));
    assert!(matches!(
        PolicyHandle::from_file(dir.path().join("none"), ENGINES),
        Err(PolicyError::Io { .. })
    ));
}

/// Polls until `cond` holds or a generous deadline passes.
async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..500 {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

#[tokio::test]
async fn watcher_reloads_on_change_and_ignores_bad_or_unchanged_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    write(&path, &config("fastpath"));
    let handle = PolicyHandle::from_file(&path, ENGINES).unwrap();
    let interval = Duration::from_millis(20);
    let watcher = handle.spawn_watcher(&path, interval);

    // Rewriting identical content changes the mtime but not the hash: no swap.
    let before = handle.current();
    tokio::time::sleep(interval * 3).await;
    write(&path, &config("fastpath"));
    tokio::time::sleep(interval * 5).await;
    assert!(
        Arc::ptr_eq(&before, &handle.current()),
        "unchanged content must not reload"
    );

    write(&path, &config("dflash"));
    assert!(
        eventually(|| greedy_engine(&handle) == "dflash").await,
        "good edit not picked up"
    );

    // A bad edit is rejected and the last good policy stays.
    let good = handle.current();
    write(&path, &config("not-an-engine"));
    tokio::time::sleep(interval * 5).await;
    assert!(Arc::ptr_eq(&good, &handle.current()));

    // Deleting the file keeps the policy; bringing a good one back loads it.
    std::fs::remove_file(&path).unwrap();
    tokio::time::sleep(interval * 5).await;
    assert_eq!(greedy_engine(&handle), "dflash");
    write(&path, &config("batched"));
    assert!(
        eventually(|| greedy_engine(&handle) == "batched").await,
        "restored file not picked up"
    );

    // The watcher stops once the last handle is gone.
    drop((handle, before, good));
    tokio::time::timeout(Duration::from_secs(5), watcher)
        .await
        .expect("watcher should exit")
        .unwrap();
}

/// The active policy counts each rule's decisions, carries a hash of its
/// section and when it loaded, and the handle remembers the last refused
/// reload until a good one replaces the policy.
#[test]
fn the_active_policy_counts_hits_and_the_last_rejection_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    write(&path, &config("fastpath"));
    let handle = PolicyHandle::from_file(&path, ENGINES).unwrap();
    let active = handle.active();
    let greedy = Signals {
        greedy: true,
        ..Signals::default()
    };
    for signals in [&greedy, &greedy, &Signals::default()] {
        active.decide(signals);
    }
    let hits: Vec<(String, String, u64)> = active
        .hits()
        .into_iter()
        .map(|h| (h.rule, h.route, h.hits))
        .collect();
    assert_eq!(
        hits,
        [
            ("greedy-to-fastpath".into(), "fastpath".into(), 2),
            ("default".into(), "batched".into(), 1)
        ]
    );
    assert_eq!(active.hash.len(), 16);
    assert!(handle.last_rejected().is_none());

    write(&path, &config("mtp"));
    handle.reload_from_file(&path).unwrap_err();
    let rejected = handle.last_rejected().expect("a rejection");
    assert!(
        rejected.error.contains("engine `mtp` is not loaded"),
        "{rejected:?}"
    );
    assert!(Arc::ptr_eq(&active, &handle.active()));

    // An unchanged section hashes the same; a new one loads with no hits.
    write(&path, &format!("# edited\n{}", config("fastpath")));
    handle.reload_from_file(&path).unwrap();
    assert_eq!(handle.active().hash, active.hash);
    write(&path, &config("dflash"));
    handle.reload_from_file(&path).unwrap();
    assert!(handle.last_rejected().is_none());
    assert_ne!(handle.active().hash, active.hash);
    assert!(handle.active().hits().iter().all(|h| h.hits == 0));
}
