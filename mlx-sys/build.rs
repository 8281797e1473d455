//! Builds mlx-c and its bindings.
//!
//! Linux: mlx-c (from the published `mlx-sys` crate that `cargo fetch` put in
//! the registry) is compiled against the prebuilt `libmlx.so` of the PyPI MLX
//! wheels (`mlx-cpu` or `mlx-cuda-13`) and libmlx is linked dynamically, so
//! the gateway and every engine plugin share one MLX in the process.
//! macOS: the upstream recipe (CMake builds MLX and mlx-c with Metal).
//!
//! Environment:
//! * `MLX_DIR`: the wheel's `mlx` package folder (holds `include/` and
//!   `lib/libmlx.so`); default `<workspace>/.mlx/mlx`, made by `scripts/setup`.
//! * `MLX_C_SRC`: the mlx-c source root; default: found in cargo's registry.
//! * `MLX_BLAS`: `openblas` (default when installed) links OpenBLAS ahead of
//!   libmlx so its BLAS/LAPACK symbols win over the wheel's reference BLAS;
//!   `bundled` keeps the wheel's own.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

const MLX_SYS_VERSION: &str = "0.7.0";

fn main() {
    for var in ["MLX_DIR", "MLX_C_SRC", "MLX_BLAS", "CARGO_HOME"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=native");

    println!("cargo::rustc-check-cfg=cfg(mlx_openblas)");
    println!("cargo::rustc-check-cfg=cfg(mlx_packed_matmul)");
    let mlx_c = mlx_c_source();
    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap();
    let target_arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap();
    if target_os == "macos" {
        apple::build(&mlx_c);
    } else {
        linux::build(&mlx_c);
    }
    generate_bindings(&mlx_c, target_arch != "aarch64");
}

/// The mlx-c sources bundled in the published mlx-sys crate.
fn mlx_c_source() -> PathBuf {
    if let Some(dir) = env::var_os("MLX_C_SRC") {
        return PathBuf::from(dir);
    }
    let cargo_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .expect("neither CARGO_HOME nor HOME is set");
    let registry = cargo_home.join("registry").join("src");
    let wanted = format!("mlx-sys-{MLX_SYS_VERSION}");
    if let Ok(indexes) = fs::read_dir(&registry) {
        for index in indexes.flatten() {
            let candidate = index.path().join(&wanted).join("src").join("mlx-c");
            if candidate.join("mlx/c/array.h").exists() {
                return candidate;
            }
        }
    }
    panic!(
        "mlx-c sources not found under {}: run `scripts/setup` (it runs \
         `cargo fetch --manifest-path mlx-sys/source/Cargo.toml`) or set MLX_C_SRC",
        registry.display()
    );
}

fn generate_bindings(mlx_c: &Path, declare_half_types: bool) {
    let header_dir = mlx_c.join("mlx/c");
    let mut headers: Vec<PathBuf> = fs::read_dir(&header_dir)
        .expect("mlx-c header directory")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "h"))
        .collect();
    headers.sort();

    let mut builder = bindgen::Builder::default()
        .rust_target("1.73.0".parse().expect("rust-version"))
        .clang_arg(format!("-I{}", mlx_c.display()))
        .blocklist_function("malloc")
        .blocklist_function("realloc");
    if declare_half_types {
        let prelude = Path::new(env!("CARGO_MANIFEST_DIR")).join("native/half_prelude.h");
        builder = builder
            .clang_arg("-include")
            .clang_arg(prelude.display().to_string())
            .blocklist_type("float16_t")
            .raw_line(
                "#[repr(transparent)]\n#[derive(Debug, Default, Copy, Clone, PartialEq, Eq, Hash)]\npub struct float16_t(pub u16);",
            );
    }
    for header in &headers {
        builder = builder.header(header.display().to_string());
    }
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("bindings.rs");
    builder
        .generate()
        .expect("unable to generate mlx-c bindings")
        .write_to_file(out)
        .expect("unable to write mlx-c bindings");
}

/// Tells dependents (`DEP_MLX_MLX_VERSION`, `DEP_MLX_MLX_C_VERSION`) which
/// MLX headers and which mlx-c this build compiled against: the runtime
/// puts both in the plugin fingerprint, since mlx-c is compiled into every
/// plugin while libmlx is one shared library in the process.
fn export_versions(include: &Path) {
    let header = include.join("mlx/version.h");
    println!("cargo:rerun-if-changed={}", header.display());
    let text = fs::read_to_string(&header).unwrap_or_default();
    let part = |name: &str| {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(&format!("#define MLX_VERSION_{name} ")))
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| "?".into())
    };
    println!(
        "cargo:mlx_version={}.{}.{}",
        part("MAJOR"),
        part("MINOR"),
        part("PATCH")
    );
    println!("cargo:mlx_c_version={MLX_SYS_VERSION}");
}

mod linux {
    use super::*;

    pub fn build(mlx_c: &Path) {
        let mlx = mlx_dir();
        let include = mlx.join("include");
        let lib = mlx.join("lib");
        assert!(
            lib.join("libmlx.so").exists(),
            "libmlx.so not found in {}: run `scripts/setup` or set MLX_DIR to the \
             `mlx` folder of an installed mlx-cpu / mlx-cuda-13 wheel",
            lib.display()
        );
        let native = Path::new(env!("CARGO_MANIFEST_DIR")).join("native");

        let mut sources: Vec<PathBuf> = fs::read_dir(mlx_c.join("mlx/c"))
            .expect("mlx-c source directory")
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "cpp"))
            .collect();
        sources.sort();
        sources.push(native.join("half_accessors.cpp"));
        sources.push(native.join("mach_time.cpp"));
        sources.push(native.join("packed_matmul.cpp"));
        sources.push(native.join("graph_nodes.cpp"));
        sources.push(native.join("cpu_fused.cpp"));

        cc::Build::new()
            .cpp(true)
            .std("c++20")
            .pic(true)
            .warnings(false)
            .opt_level(2)
            .include(mlx_c)
            .include(&include)
            .flag("-include")
            .flag(native.join("format_compat.h").display().to_string())
            .files(&sources)
            .compile("mlxc");

        // native/packed_matmul.cpp: packed-weight products for the CPU.
        println!("cargo:rustc-cfg=mlx_packed_matmul");
        println!("cargo:rustc-link-search=native={}", lib.display());
        if let Some(openblas) = openblas_dir() {
            // A direct dependency of every binary that calls
            // `blas_backend()` (the runtime does at model load): the global
            // symbol lookup then finds OpenBLAS before the wheel's reference
            // BLAS, which libmlx only pulls in as an indirect dependency.
            // One-row products go to OpenBLAS's sgemv (see the file).
            cc::Build::new()
                .file(native.join("sgemv_forward.c"))
                .pic(true)
                .opt_level(2)
                .compile("mlx_sgemv_forward");
            println!("cargo:rustc-link-search=native={}", openblas.display());
            println!("cargo:rustc-link-lib=dylib=openblas");
            println!("cargo:rustc-cfg=mlx_openblas");
        }
        println!("cargo:rustc-link-lib=dylib=mlx");
        println!("cargo:lib_dir={}", lib.display());
        println!("cargo:include={}", include.display());
        super::export_versions(&include);
    }

    fn mlx_dir() -> PathBuf {
        if let Some(dir) = env::var_os("MLX_DIR") {
            return PathBuf::from(dir);
        }
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .join(".mlx/mlx")
    }

    fn openblas_dir() -> Option<PathBuf> {
        match env::var("MLX_BLAS").as_deref() {
            Ok("bundled") => return None,
            Ok("openblas") | Err(_) => {}
            Ok(other) => panic!("MLX_BLAS must be `openblas` or `bundled`, not `{other}`"),
        }
        let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap();
        let found = [
            format!("/usr/lib/{arch}-linux-gnu"),
            "/usr/lib64".into(),
            "/usr/lib".into(),
        ]
        .into_iter()
        .map(PathBuf::from)
        .find(|d| d.join("libopenblas.so").exists());
        if found.is_none() && env::var("MLX_BLAS").is_ok() {
            panic!("MLX_BLAS=openblas but libopenblas.so is not installed (Debian: libopenblas-dev)");
        }
        found
    }
}

mod apple {
    use super::*;

    /// The upstream mlx-sys recipe: CMake fetches and builds MLX with Metal
    /// and Accelerate, and mlx-c is linked statically.
    pub fn build(mlx_c: &Path) {
        let mut config = cmake::Config::new(mlx_c);
        config.define("CMAKE_INSTALL_PREFIX", ".");
        config.define("CMAKE_C_COMPILER", "/usr/bin/cc");
        config.define("CMAKE_CXX_COMPILER", "/usr/bin/c++");
        config.define("MLX_C_BUILD_EXAMPLES", "OFF");
        config.define(
            "MLX_BUILD_METAL",
            if cfg!(feature = "metal") { "ON" } else { "OFF" },
        );
        config.define(
            "MLX_BUILD_ACCELERATE",
            if cfg!(feature = "accelerate") { "ON" } else { "OFF" },
        );
        if cfg!(feature = "metal-jit") {
            config.define("MLX_METAL_JIT", "ON");
        }
        let dst = config.build();
        super::export_versions(&dst.join("include"));
        println!("cargo:rustc-link-search=native={}/build/lib", dst.display());
        println!("cargo:rustc-link-search=native={}/build", dst.display());
        println!("cargo:rustc-link-lib=static=mlx");
        println!("cargo:rustc-link-lib=static=mlxc");
        println!("cargo:rustc-link-lib=c++");
        println!("cargo:rustc-link-lib=dylib=objc");
        println!("cargo:rustc-link-lib=framework=Foundation");
        if cfg!(feature = "metal") {
            println!("cargo:rustc-link-lib=framework=Metal");
        }
        if cfg!(feature = "accelerate") {
            println!("cargo:rustc-link-lib=framework=Accelerate");
        }
    }
}
