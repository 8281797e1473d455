//! The binaries under test, built once per test process.
//!
//! `cargo test -p e2e-tests` only builds this crate, so the gateway and the
//! plugins are built here with one `cargo build` of the packages below.
//! The out-of-tree template plugin is built apart, in its own cargo
//! invocation with its own lock file and target directory
//! ([`template_plugin`]), as a third-party author builds one.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Packages built for the tests: the gateway, the real engines it loads
/// from its own directory by default, the test plugins loaded by path, the
/// serving benchmark and the model writers (`fixtures`).
pub const PACKAGES: &[&str] = &[
    "gateway",
    "fixtures",
    "bench",
    "engine-batched",
    "engine-fastpath",
    "engine-remote",
    "engine-dflash",
    "engine-mtp",
    "engine-reference",
    "engine-mismatch",
];

#[derive(Debug)]
pub struct Binaries {
    /// `target/<profile>`, where cargo puts binaries and plugins.
    pub dir: PathBuf,
    pub gateway: PathBuf,
    pub reference_plugin: PathBuf,
    pub mismatch_plugin: PathBuf,
    pub bench: PathBuf,
    /// `fixtures make-tiny-model` / `make-tiny-drafter`.
    pub fixtures: PathBuf,
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_owned()
}

fn plugin_file(lib: &str) -> String {
    format!(
        "{}{lib}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    )
}

/// Builds (once) and returns the paths. Panics with cargo's output when the
/// build fails.
pub fn binaries() -> &'static Binaries {
    static BUILT: OnceLock<Binaries> = OnceLock::new();
    BUILT.get_or_init(|| {
        // This test binary lives in target/<profile>/deps.
        let exe = std::env::current_exe().expect("current exe");
        let deps = exe.parent().expect("exe dir");
        let dir = deps.parent().expect("profile dir").to_owned();
        let target_dir = dir.parent().expect("target dir").to_owned();
        let profile = match dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => "dev".to_owned(),
            Some(other) => other.to_owned(),
            None => "dev".to_owned(),
        };
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(workspace_root())
            .args(["build", "--profile", &profile, "--target-dir"])
            .arg(&target_dir);
        for p in PACKAGES {
            cmd.args(["-p", p]);
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "building {PACKAGES:?} failed");
        Binaries {
            gateway: dir.join(format!("gateway{}", std::env::consts::EXE_SUFFIX)),
            reference_plugin: dir.join(plugin_file("engine_reference")),
            mismatch_plugin: dir.join(plugin_file("engine_mismatch")),
            bench: dir.join(format!("bench{}", std::env::consts::EXE_SUFFIX)),
            fixtures: dir.join(format!("fixtures{}", std::env::consts::EXE_SUFFIX)),
            dir,
        }
    })
}

/// The out-of-tree template plugin (examples/plugin-template), built once
/// per test process by a separate `cargo build --release --locked` with its
/// own manifest, lock file and target directory (`target/plugin-template`,
/// kept between runs so CI compiles its dependencies once). Returns the
/// `.so` and how long the build took.
pub fn template_plugin() -> &'static (PathBuf, std::time::Duration) {
    static BUILT: OnceLock<(PathBuf, std::time::Duration)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let root = workspace_root();
        let manifest = root.join("examples/plugin-template/Cargo.toml");
        let target_dir = binaries()
            .dir
            .parent()
            .expect("target dir")
            .join("plugin-template");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let started = std::time::Instant::now();
        let status = Command::new(cargo)
            .current_dir(root.join("examples/plugin-template"))
            .args(["build", "--release", "--locked", "--manifest-path"])
            .arg(&manifest)
            .arg("--target-dir")
            .arg(&target_dir)
            // Nothing of the workspace's build leaks into this one.
            .env_remove("CARGO_TARGET_DIR")
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .status()
            .expect("run cargo build for the template plugin");
        assert!(status.success(), "building examples/plugin-template failed");
        let elapsed = started.elapsed();
        eprintln!(
            "built examples/plugin-template apart in {:.1} s",
            elapsed.as_secs_f64()
        );
        (
            target_dir
                .join("release")
                .join(plugin_file("engine_template")),
            elapsed,
        )
    })
}
