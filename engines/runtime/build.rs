// The MLX part of the plugin fingerprint: the MLX headers and mlx-c this
// build compiled against (from mlx-sys). Plugins built against another are
// refused: their arrays are not this libmlx's.
fn main() {
    let mlx = std::env::var("DEP_MLX_MLX_VERSION").unwrap_or_else(|_| "?".into());
    let mlx_c = std::env::var("DEP_MLX_MLX_C_VERSION").unwrap_or_else(|_| "?".into());
    println!("cargo:rustc-env=RUNTIME_MLX_FINGERPRINT=mlx {mlx}, mlx-c of mlx-sys {mlx_c}");
}
