//! Opening engine plugins. The descriptor is C: the boundary's major
//! version is read first, then the MLX fingerprint (MLX, mlx-c and the
//! shared-state tables' version). A plugin that differs in either is
//! refused here, at load, with both values and what to rebuild named, and
//! the rest of the gateway carries on. Nothing of the plugin is called
//! before that.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use engine_core::plugin::abi::{EntryFn, PluginDescriptor, PluginVTable};
use engine_core::plugin::export::CreateArgs;
use engine_core::plugin::import::PluginEngine;
use engine_core::plugin::{read_c_str, ENTRY_SYMBOL, OLD_ENTRY_SYMBOL, PLUGIN_ABI_VERSION};
use libloading::Library;

/// Libraries stay loaded for the life of the process: engines built from
/// them run their code (and drop their state) until the very end.
static LIBRARIES: Mutex<Vec<Library>> = Mutex::new(Vec::new());

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("cannot load plugin {}: {error} (a stripped, truncated or foreign file? rebuild it)", path.display())]
    Open {
        path: PathBuf,
        error: libloading::Error,
    },
    #[error("cannot load plugin {}: {reason} (a stripped, truncated or foreign file? rebuild it)", path.display())]
    Truncated { path: PathBuf, reason: String },
    #[error("plugin {} was built for an older gateway (Rust-ABI plugins, entry `engine_plugin_entry_v1`); rebuild it against this gateway's engine-core", path.display())]
    OldBoundary { path: PathBuf },
    #[error("{} is not an engine plugin (no `engine_plugin_entry_v2` symbol): {error}", path.display())]
    NoEntry {
        path: PathBuf,
        error: libloading::Error,
    },
    #[error("plugin {} returned no descriptor", path.display())]
    NullDescriptor { path: PathBuf },
    #[error("plugin {} refused: {}", path.display(), mismatches.join("; "))]
    Mismatch {
        path: PathBuf,
        mismatches: Vec<String>,
    },
    #[error("plugin {} names no engine kind or exports no functions", path.display())]
    Incomplete { path: PathBuf },
}

/// What a descriptor says it was built against, as plain values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// The boundary's major version.
    pub abi: u32,
    /// MLX, mlx-c and the shared-state tables; empty for a plugin that
    /// does not link MLX.
    pub mlx: String,
}

impl Fingerprint {
    pub fn host() -> Self {
        Fingerprint {
            abi: PLUGIN_ABI_VERSION,
            mlx: runtime::abi::mlx_fingerprint().to_owned(),
        }
    }

    /// Every field that differs, each naming the plugin's value, the
    /// host's, and what to rebuild.
    pub fn mismatches(&self, host: &Fingerprint) -> Vec<String> {
        let mut out = Vec::new();
        if self.abi != host.abi {
            out.push(format!(
                "plugin ABI version {} (gateway has {}): rebuild the plugin against this gateway's engine-core",
                self.abi, host.abi
            ));
            // The other fields' layout is unknown.
            return out;
        }
        if !self.mlx.is_empty() && self.mlx != host.mlx {
            out.push(format!(
                "built against `{}` (gateway has `{}`): rebuild the plugin with this gateway's MLX (scripts/setup) and runtime crate",
                self.mlx, host.mlx
            ));
        }
        out
    }
}

/// A plugin whose fingerprints matched; its functions are safe to call.
pub struct Plugin {
    pub path: PathBuf,
    pub kind: String,
    pub fingerprint: Fingerprint,
    vtable: &'static PluginVTable,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.path)
            .field("kind", &self.kind)
            .finish()
    }
}

/// Refuses a file whose loadable segments reach past its end: the dynamic
/// loader maps them anyway and the process dies of SIGBUS when it touches
/// them (a truncated copy, an interrupted build). Files that are not ELF
/// at all are left to the loader's own checks.
fn check_segments(path: &Path) -> Result<(), String> {
    use object::{Object, ObjectSegment};
    let data = std::fs::read(path).map_err(|e| e.to_string())?;
    if !data.starts_with(b"\x7fELF") {
        return Ok(());
    }
    let file = object::File::parse(&*data).map_err(|e| format!("a damaged ELF file: {e}"))?;
    let len = data.len() as u64;
    for segment in file.segments() {
        let (offset, size) = segment.file_range();
        if offset.saturating_add(size) > len {
            return Err(format!(
                "truncated: a segment spans bytes {offset}..{} of a {len}-byte file",
                offset + size
            ));
        }
    }
    Ok(())
}

impl Plugin {
    pub fn open(path: &Path) -> Result<Plugin, PluginError> {
        let path_buf = || path.to_owned();
        check_segments(path).map_err(|reason| PluginError::Truncated {
            path: path_buf(),
            reason,
        })?;
        // SAFETY: loading runs the library's initialisers; plugins are
        // trusted code named by the operator.
        let lib = unsafe { Library::new(path) }.map_err(|error| PluginError::Open {
            path: path_buf(),
            error,
        })?;
        // SAFETY: the symbol's type is fixed by the plugin ABI.
        let entry: EntryFn = match unsafe { lib.get::<EntryFn>(ENTRY_SYMBOL) } {
            Ok(sym) => *sym,
            Err(error) => {
                let old = unsafe { lib.get::<EntryFn>(OLD_ENTRY_SYMBOL) }.is_ok();
                return Err(if old {
                    PluginError::OldBoundary { path: path_buf() }
                } else {
                    PluginError::NoEntry {
                        path: path_buf(),
                        error,
                    }
                });
            }
        };
        // SAFETY: the entry only returns a pointer to a static.
        let descriptor: *const PluginDescriptor = unsafe { entry() };
        if descriptor.is_null() {
            return Err(PluginError::NullDescriptor { path: path_buf() });
        }
        // SAFETY: the layout version is the first field of every
        // descriptor layout; the rest is read only once it matches.
        let abi = unsafe { std::ptr::addr_of!((*descriptor).abi_version).read() };
        let mut fingerprint = Fingerprint {
            abi,
            mlx: String::new(),
        };
        let host = Fingerprint::host();
        if abi == host.abi {
            fingerprint.mlx = unsafe { read_c_str((*descriptor).mlx) };
        }
        let mismatches = fingerprint.mismatches(&host);
        if !mismatches.is_empty() {
            return Err(PluginError::Mismatch {
                path: path_buf(),
                mismatches,
            });
        }
        // SAFETY: the layout is ours; the strings and table are statics.
        let d = unsafe { &*descriptor };
        let kind = unsafe { read_c_str(d.kind) };
        let Some(vtable) = (unsafe { d.vtable.as_ref() }).filter(|_| !kind.is_empty()) else {
            return Err(PluginError::Incomplete { path: path_buf() });
        };
        LIBRARIES
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(lib);
        Ok(Plugin {
            path: path_buf(),
            kind,
            fingerprint,
            vtable,
        })
    }

    /// Builds an engine over the host's shared state
    /// (`runtime::SharedModel::export`).
    pub fn create(
        &self,
        args: &CreateArgs,
        shared: *const std::ffi::c_void,
    ) -> Result<Box<dyn engine_core::Engine>, String> {
        // SAFETY: the plugin stays loaded, its fingerprints matched, and
        // `shared` lives for the process.
        let engine = unsafe { PluginEngine::create(self.vtable, args, shared)? };
        Ok(Box::new(engine))
    }
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
    fn mismatches_name_both_values_and_what_to_rebuild() {
        let host = Fingerprint {
            abi: 4,
            mlx: "mlx 0.32.2, mlx-c of mlx-sys 0.7.0, shared state v1".into(),
        };
        assert!(host.mismatches(&host).is_empty());
        let other = Fingerprint {
            mlx: "mlx 0.30.0, mlx-c of mlx-sys 0.7.0, shared state v1".into(),
            ..host.clone()
        };
        let m = other.mismatches(&host);
        assert_eq!(m.len(), 1, "{m:?}");
        assert!(m[0].contains("mlx 0.30.0") && m[0].contains("mlx 0.32.2") && m[0].contains("MLX"));
        // A plugin that does not link MLX has no MLX to mismatch.
        let no_mlx = Fingerprint {
            mlx: String::new(),
            ..host.clone()
        };
        assert!(no_mlx.mismatches(&host).is_empty());
        // Another descriptor layout: nothing else can be read.
        let old = Fingerprint { abi: 3, ..other };
        let m = old.mismatches(&host);
        assert_eq!(m.len(), 1);
        assert!(
            m[0].contains("plugin ABI version 3 (gateway has 4)"),
            "{m:?}"
        );
    }

    #[test]
    fn host_fingerprint_is_clean() {
        let f = Fingerprint::host();
        assert!(
            f.mlx.starts_with("mlx ") && !f.mlx.contains('\0'),
            "{}",
            f.mlx
        );
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

    #[test]
    fn a_truncated_shared_object_is_refused_before_the_loader_maps_it() {
        // This test binary is an ELF file like any plugin; cut short, the
        // loader would map its segments past the end and die of SIGBUS.
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("libengine_cut.so");
        std::fs::write(&path, &me[..4096]).unwrap();
        let e = Plugin::open(&path).unwrap_err();
        assert!(matches!(e, PluginError::Truncated { .. }), "{e}");
        assert!(
            e.to_string().contains("truncated") && e.to_string().contains("rebuild"),
            "{e}"
        );
    }
}
