//! Opening engine plugins. The descriptor's version fields are read and
//! compared with the host's before the plugin's Rust constructor is touched:
//! a plugin built against another ABI, engine-core or rustc is refused with
//! both versions named, and the rest of the gateway carries on.

use std::ffi::c_char;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use engine_core::plugin::{
    Constructor, EntryFn, PluginDescriptor, CORE_VERSION, ENTRY_SYMBOL, PLUGIN_ABI_VERSION,
    RUSTC_VERSION,
};
use libloading::Library;

/// Libraries stay loaded for the life of the process: engines built from
/// them run their code (and drop their state) until the very end.
static LIBRARIES: Mutex<Vec<Library>> = Mutex::new(Vec::new());

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("cannot load plugin {}: {error}", path.display())]
    Open {
        path: PathBuf,
        error: libloading::Error,
    },
    #[error("{} is not an engine plugin (no `engine_plugin_entry_v1` symbol): {error}", path.display())]
    NoEntry {
        path: PathBuf,
        error: libloading::Error,
    },
    #[error("plugin {} returned no descriptor", path.display())]
    NullDescriptor { path: PathBuf },
    #[error("plugin {} refused: {}; rebuild it against this gateway's engine-core", path.display(), mismatches.join("; "))]
    Mismatch {
        path: PathBuf,
        mismatches: Vec<String>,
    },
    #[error("plugin {} names no engine kind", path.display())]
    NoKind { path: PathBuf },
}

/// The version fields of a descriptor, as plain values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versions {
    pub abi: u32,
    pub core: String,
    pub rustc: String,
}

impl Versions {
    pub fn host() -> Self {
        Versions {
            abi: PLUGIN_ABI_VERSION,
            core: CORE_VERSION.trim_end_matches('\0').to_owned(),
            rustc: RUSTC_VERSION.trim_end_matches('\0').to_owned(),
        }
    }

    /// Every field that differs, each naming the plugin's and the host's
    /// value.
    pub fn mismatches(&self, host: &Versions) -> Vec<String> {
        let mut out = Vec::new();
        if self.abi != host.abi {
            out.push(format!(
                "plugin ABI version {} (gateway has {})",
                self.abi, host.abi
            ));
        }
        if self.core != host.core {
            out.push(format!(
                "engine-core version {} (gateway has {})",
                self.core, host.core
            ));
        }
        if self.rustc != host.rustc {
            out.push(format!(
                "built with `{}` (gateway built with `{}`)",
                self.rustc, host.rustc
            ));
        }
        out
    }
}

/// A plugin whose versions matched; its constructor is safe to call.
pub struct Plugin {
    pub path: PathBuf,
    pub kind: String,
    pub versions: Versions,
    create: Constructor,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.path)
            .field("kind", &self.kind)
            .finish()
    }
}

impl Plugin {
    pub fn open(path: &Path) -> Result<Plugin, PluginError> {
        // SAFETY: loading runs the library's initialisers; plugins are
        // trusted code named by the operator.
        let lib = unsafe { Library::new(path) }.map_err(|error| PluginError::Open {
            path: path.to_owned(),
            error,
        })?;
        // SAFETY: the symbol's type is fixed by the plugin ABI.
        let entry: EntryFn = unsafe { lib.get::<EntryFn>(ENTRY_SYMBOL) }
            .map(|sym| *sym)
            .map_err(|error| PluginError::NoEntry {
                path: path.to_owned(),
                error,
            })?;
        // SAFETY: calling the entry only returns a pointer to a static.
        let descriptor = unsafe { entry() };
        if descriptor.is_null() {
            return Err(PluginError::NullDescriptor {
                path: path.to_owned(),
            });
        }
        // SAFETY: the leading C-layout fields are read one by one, without
        // forming a reference to the whole (Rust-typed) descriptor.
        let (versions, kind) = unsafe {
            let abi = std::ptr::addr_of!((*descriptor).abi_version).read();
            let core = read_c_str(std::ptr::addr_of!((*descriptor).core_version).read());
            let rustc = read_c_str(std::ptr::addr_of!((*descriptor).rustc_version).read());
            (
                Versions { abi, core, rustc },
                std::ptr::addr_of!((*descriptor).kind),
            )
        };
        let mismatches = versions.mismatches(&Versions::host());
        if !mismatches.is_empty() {
            return Err(PluginError::Mismatch {
                path: path.to_owned(),
                mismatches,
            });
        }
        // SAFETY: the versions match, so the descriptor's layout is ours.
        let (kind, create) = unsafe { (read_c_str(kind.read()), (*descriptor).create) };
        if kind.is_empty() {
            return Err(PluginError::NoKind {
                path: path.to_owned(),
            });
        }
        LIBRARIES
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(lib);
        Ok(Plugin {
            path: path.to_owned(),
            kind,
            versions,
            create,
        })
    }

    /// Builds an engine. A panicking constructor is reported as an error.
    pub fn create(
        &self,
        ctx: engine_core::EngineContext,
    ) -> Result<Box<dyn engine_core::Engine>, String> {
        let create = self.create;
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| create(ctx)))
            .unwrap_or_else(|_| Err("the engine constructor panicked".to_owned()))
    }
}

/// # Safety
/// `ptr` is null or a NUL-terminated string in a loaded library.
unsafe fn read_c_str(ptr: *const c_char) -> String {
    PluginDescriptor::read_str(ptr)
}

/// The file name a plugin of `kind` has in the plugin directory
/// (`libengine_batched.so` on Linux).
pub fn file_name(kind: &str) -> String {
    format!(
        "{}engine_{}{}",
        std::env::consts::DLL_PREFIX,
        kind.replace('-', "_"),
        std::env::consts::DLL_SUFFIX
    )
}

/// Where the build puts plugins: next to the executable, and one level up
/// for test binaries that live in `target/<profile>/deps`.
pub fn default_dirs() -> Vec<PathBuf> {
    let Ok(exe) = std::env::current_exe() else {
        return Vec::new();
    };
    let Some(dir) = exe.parent() else {
        return Vec::new();
    };
    let mut dirs = vec![dir.to_owned()];
    if dir.file_name().is_some_and(|n| n == "deps") {
        if let Some(parent) = dir.parent() {
            dirs.push(parent.to_owned());
        }
    }
    dirs
}

/// The plugin file for `kind` in the first directory that has one.
pub fn find(kind: &str, dirs: &[PathBuf]) -> Option<PathBuf> {
    let name = file_name(kind);
    dirs.iter().map(|d| d.join(&name)).find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatch_names_both_versions() {
        let host = Versions {
            abi: 1,
            core: "0.1.0".into(),
            rustc: "rustc 1.95.0".into(),
        };
        let plugin = Versions {
            abi: 2,
            core: "0.2.0".into(),
            rustc: "rustc 1.95.0".into(),
        };
        let m = plugin.mismatches(&host);
        assert_eq!(m.len(), 2);
        assert!(m[0].contains('2') && m[0].contains('1'), "{m:?}");
        assert!(m[1].contains("0.2.0") && m[1].contains("0.1.0"), "{m:?}");
        assert!(host.mismatches(&host).is_empty());
        let other_rustc = Versions {
            rustc: "rustc 1.80.0".into(),
            ..host.clone()
        };
        assert!(other_rustc.mismatches(&host)[0].contains("1.80.0"));
    }

    #[test]
    fn host_versions_are_clean_strings() {
        let v = Versions::host();
        assert!(!v.core.is_empty() && !v.core.contains('\0'));
        assert!(v.rustc.starts_with("rustc "));
    }

    #[test]
    fn plugin_file_names() {
        if cfg!(target_os = "linux") {
            assert_eq!(file_name("batched"), "libengine_batched.so");
            assert_eq!(file_name("my-engine"), "libengine_my_engine.so");
        }
    }

    #[test]
    fn opening_a_non_plugin_fails_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("libengine_fake.so");
        std::fs::write(&path, b"not a shared object").unwrap();
        let e = Plugin::open(&path).unwrap_err();
        assert!(matches!(e, PluginError::Open { .. }), "{e}");
        assert!(Plugin::open(&dir.path().join("missing.so")).is_err());
    }
}
