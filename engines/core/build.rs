// Records the compiler version so a plugin built by another rustc (whose Rust
// ABI may differ) is refused by the host instead of crashing it.
fn main() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let out = std::process::Command::new(rustc)
        .arg("--version")
        .output()
        .expect("run rustc --version");
    let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    println!("cargo:rustc-env=ENGINE_CORE_RUSTC_VERSION={version}");
    println!("cargo:rerun-if-env-changed=RUSTC");
}
