// The MLX part of the plugin fingerprint: the MLX headers and mlx-c this
// build compiled against (from mlx-sys) and a hash of the shared-state C
// structures (src/abi.rs). Plugins built against anything else are refused.
fn main() {
    let path = "src/abi.rs";
    println!("cargo:rerun-if-changed={path}");
    let text = std::fs::read_to_string(path).expect("read src/abi.rs");
    // FNV-1a, as engine-core's boundary hash.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.replace("\r\n", "\n").bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    let mlx = std::env::var("DEP_MLX_MLX_VERSION").unwrap_or_else(|_| "?".into());
    let mlx_c = std::env::var("DEP_MLX_MLX_C_VERSION").unwrap_or_else(|_| "?".into());
    println!(
        "cargo:rustc-env=RUNTIME_MLX_FINGERPRINT=mlx {mlx}, mlx-c of mlx-sys {mlx_c}, shared state {hash:016x}"
    );
}
