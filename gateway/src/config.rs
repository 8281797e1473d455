//! config.yaml: the model, the server, the engines, third-party plugins and
//! the routing policy (validated by the `policies` crate).
//!
//! ```yaml
//! model:
//!   path: models/tiny-qwen3   # relative paths are relative to this file
//!   name: tiny-qwen3          # served name (default: the directory name)
//!   kv_cache_mb: 1024         # shared KV block pool (default 1024, or what `memory:` leaves)
//!   kv_block_size: 16         # tokens per block
//!   prefix_cache_entries: 16  # block-aligned prefixes kept for every engine (0: off)
//!   kv_layout: contiguous     # or paged: one preallocated block pool for every engine
//!   default_max_tokens: 4096  # cap on max_tokens when a request omits it
//!   compute_dtype: auto       # auto (fp32 on the CPU, the checkpoint's on the GPU),
//!                             # float32, bfloat16 or float16
//!   kv_cache: { bits: 8, group_size: 64 }  # quantized full-attention KV
//!                             # (bits 8 or 4, group 32/64/128); off when absent
//! server:
//!   host: 127.0.0.1
//!   port: 8000
//!   body_limit_bytes: 4194304
//!   request_timeout_s: 600    # time until response headers (streams: first chunk)
//!   max_concurrent: 256       # generation requests in flight
//!   max_queued: 1024          # waiting beyond that; then 429 + Retry-After
//!   api_keys: []              # when any key is set, /v1 requires one
//!   api_keys_env: GATEWAY_API_KEYS   # comma-separated keys from the environment
//!   policy_reload_ms: 1000    # how often the policy file is checked for edits
//!   shutdown_grace_s: 30      # on SIGTERM: in-flight requests get this long to finish
//!   max_n: 8                  # choices per request (`n`), prompts x n per completions request
//!   engine_probe_s: 10        # an engine benched by a panic is probed this often (0: never)
//! memory:                     # optional: a memory budget the server keeps
//!   fraction: 0.9             # of the device's memory (or `limit_mb: 20000`)
//!   step_tokens: 512          # the largest step, measured at startup for activations
//!   when_short: fail          # less free on the device than that needs: fail, or shrink the KV pool
//! plugin_dir: null            # default: the executable's directory
//! plugins: [path/to/libengine_x.so]
//! engines:
//!   batched: { kind: batched }        # loads libengine_batched.so
//! policy: { default: batched, rules: [] }
//! vision: { max_images: 8 }   # images in requests: see crate::vision::settings
//! ```

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_yaml::Value;

pub use crate::host::memory::MemoryConfig;
use crate::vision::VisionSettings;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    // Causes are part of the message, not `#[source]`s, so printing the
    // error chain does not repeat them.
    #[error("cannot read {}: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{}: {error}", path.display())]
    Yaml {
        path: PathBuf,
        error: serde_yaml::Error,
    },
    #[error("{}: engine `{name}`: {reason}", path.display())]
    Engine {
        path: PathBuf,
        name: String,
        reason: String,
    },
    #[error("{}: {reason}", path.display())]
    Invalid { path: PathBuf, reason: String },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    model: ModelConfig,
    #[serde(default)]
    server: ServerConfig,
    #[serde(default)]
    plugin_dir: Option<PathBuf>,
    #[serde(default)]
    plugins: Vec<PathBuf>,
    #[serde(default)]
    engines: serde_yaml::Mapping,
    /// Validated by the policies crate against the engines that loaded.
    #[allow(dead_code)]
    policy: Option<Value>,
    #[serde(default)]
    vision: VisionSettings,
    #[serde(default)]
    memory: Option<MemoryConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub path: PathBuf,
    #[serde(default)]
    pub name: Option<String>,
    /// The KV pool's size; without it, 1024 MiB, or with a `memory:`
    /// budget whatever the budget leaves (this then caps it).
    #[serde(default)]
    pub kv_cache_mb: Option<usize>,
    #[serde(default = "defaults::kv_block_size")]
    pub kv_block_size: usize,
    /// Block-aligned prefixes kept in the prefix cache all engines share.
    #[serde(default = "defaults::prefix_cache_entries")]
    pub prefix_cache_entries: usize,
    #[serde(default = "defaults::default_max_tokens")]
    pub default_max_tokens: u32,
    /// The dtype weights and activations compute in (KV is cached in it,
    /// unless `kv_cache` quantizes it).
    #[serde(default)]
    pub compute_dtype: runtime::ComputeDtype,
    /// Full-attention keys and values stored quantized (off by default).
    #[serde(default)]
    pub kv_cache: Option<runtime::KvQuant>,
    /// Where every engine's keys and values live: `contiguous` (arrays per
    /// sequence, grown as they fill) or `paged` (blocks of one pool taken
    /// at startup for the whole KV budget, shared by every engine and the
    /// prefix cache). docs/batching.md says what each costs.
    #[serde(default)]
    pub kv_layout: runtime::paged::KvLayout,
    /// Where sampling knobs a request leaves out come from.
    #[serde(default)]
    pub generation_config: GenerationConfig,
    /// Whether start-up builds the forward shapes serving will meet.
    #[serde(default)]
    pub warm_up: WarmUp,
}

/// Start-up warm-up (the model's forward shapes, then bursts of requests
/// through every local engine): `auto` on a GPU only (MLX builds kernels
/// per shape there; the CPU builds nothing), `on` on the CPU too, `off`
/// never (a faster start; the first burst pays).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmUp {
    #[default]
    Auto,
    On,
    Off,
}

impl WarmUp {
    pub fn runs(self) -> bool {
        match self {
            Self::Auto => !runtime::compute::on_cpu(),
            Self::On => true,
            Self::Off => false,
        }
    }
}

/// `auto`: the checkpoint's `generation_config.json` (or a GGUF file's
/// `general.sampling.*`), as vLLM does; `none`: greedy decoding, no
/// truncation, whatever the checkpoint recommends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GenerationConfig {
    #[default]
    Auto,
    None,
}

impl GenerationConfig {
    /// The defaults requests get, from the checkpoint's `recommended`.
    pub fn defaults(
        self,
        recommended: engine_core::SamplingDefaults,
    ) -> engine_core::SamplingDefaults {
        match self {
            Self::Auto => recommended,
            Self::None => engine_core::SamplingDefaults::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub host: IpAddr,
    pub port: u16,
    pub body_limit_bytes: usize,
    pub request_timeout_s: f64,
    pub max_concurrent: usize,
    pub max_queued: usize,
    pub api_keys: Vec<String>,
    pub api_keys_env: Option<String>,
    pub policy_reload_ms: u64,
    pub shutdown_grace_s: f64,
    /// Most choices one request may ask for (`n`, and on completions the
    /// prompts times `n`).
    pub max_n: u32,
    /// Seconds between probe requests to an engine benched by a panic or
    /// a lost stream (0: it stays out until restart).
    pub engine_probe_s: f64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 8000,
            body_limit_bytes: 4 << 20,
            request_timeout_s: 600.0,
            max_concurrent: 256,
            max_queued: 1024,
            api_keys: Vec::new(),
            api_keys_env: None,
            policy_reload_ms: 1000,
            shutdown_grace_s: 30.0,
            max_n: 8,
            engine_probe_s: 10.0,
        }
    }
}

mod defaults {
    pub fn kv_block_size() -> usize {
        16
    }
    pub fn prefix_cache_entries() -> usize {
        runtime::shared::DEFAULT_PREFIX_CACHE_ENTRIES
    }
    pub fn default_max_tokens() -> u32 {
        4096
    }
}

/// One entry of `engines:`: its name, the plugin kind, and its whole
/// section, handed to the engine as its own configuration.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    pub name: String,
    pub kind: String,
    pub section: Value,
}

/// The validated configuration, paths resolved.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file this was read from; the policy watcher re-reads it.
    pub path: PathBuf,
    pub model: ModelConfig,
    pub server: ServerConfig,
    pub plugin_dir: Option<PathBuf>,
    pub plugins: Vec<PathBuf>,
    pub engines: Vec<EngineSpec>,
    pub vision: VisionSettings,
    pub memory: Option<MemoryConfig>,
}

/// Command-line values that replace the file's.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub model: Option<PathBuf>,
    pub host: Option<IpAddr>,
    pub port: Option<u16>,
}

impl Config {
    pub fn load(path: &Path, overrides: &Overrides) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            path: path.to_owned(),
            error,
        })?;
        Self::parse(&text, path, overrides)
    }

    pub fn parse(text: &str, path: &Path, overrides: &Overrides) -> Result<Self, ConfigError> {
        let raw: RawConfig = serde_yaml::from_str(text).map_err(|error| ConfigError::Yaml {
            path: path.to_owned(),
            error,
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let resolve = |p: &Path| {
            if p.is_absolute() {
                p.to_owned()
            } else {
                base.join(p)
            }
        };
        let invalid = |reason: String| ConfigError::Invalid {
            path: path.to_owned(),
            reason,
        };

        let mut model = raw.model;
        model.path = match &overrides.model {
            Some(dir) => dir.clone(),
            None => resolve(&model.path),
        };
        if model.kv_block_size == 0 {
            return Err(invalid("model.kv_block_size must be at least 1".into()));
        }
        if model.kv_cache_mb == Some(0) {
            return Err(invalid("model.kv_cache_mb must be at least 1".into()));
        }
        if let Some(kv) = &model.kv_cache {
            kv.check().map_err(invalid)?;
        }
        if model.default_max_tokens == 0 {
            return Err(invalid(
                "model.default_max_tokens must be at least 1".into(),
            ));
        }
        let mut server = raw.server;
        if let Some(host) = overrides.host {
            server.host = host;
        }
        if let Some(port) = overrides.port {
            server.port = port;
        }
        if !(server.request_timeout_s > 0.0 && server.request_timeout_s.is_finite()) {
            return Err(invalid(
                "server.request_timeout_s must be a positive number".into(),
            ));
        }
        if !(server.shutdown_grace_s >= 0.0 && server.shutdown_grace_s.is_finite()) {
            return Err(invalid(
                "server.shutdown_grace_s must be a non-negative number".into(),
            ));
        }
        if server.max_concurrent == 0 {
            return Err(invalid("server.max_concurrent must be at least 1".into()));
        }
        if server.max_n == 0 {
            return Err(invalid("server.max_n must be at least 1".into()));
        }
        let engines = raw
            .engines
            .iter()
            .map(|(name, section)| engine_spec(path, name, section))
            .collect::<Result<Vec<_>, _>>()?;
        if engines.is_empty() {
            return Err(invalid("`engines:` names no engine".into()));
        }
        raw.vision.check().map_err(invalid)?;
        if let Some(memory) = &raw.memory {
            memory.check().map_err(invalid)?;
        }
        Ok(Config {
            path: path.to_owned(),
            model,
            server,
            plugin_dir: raw.plugin_dir.as_deref().map(resolve),
            plugins: raw.plugins.iter().map(|p| resolve(p)).collect(),
            engines,
            vision: raw.vision.clone(),
            memory: raw.memory.clone(),
        })
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.server.request_timeout_s)
    }

    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs_f64(self.server.shutdown_grace_s)
    }

    /// Keys from the file plus those in `api_keys_env`; empty means no auth.
    pub fn api_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .server
            .api_keys
            .iter()
            .filter(|k| !k.is_empty())
            .cloned()
            .collect();
        if let Some(var) = &self.server.api_keys_env {
            if let Ok(value) = std::env::var(var) {
                keys.extend(
                    value
                        .split(',')
                        .map(str::trim)
                        .filter(|k| !k.is_empty())
                        .map(String::from),
                );
            }
        }
        keys
    }
}

fn engine_spec(path: &Path, name: &Value, section: &Value) -> Result<EngineSpec, ConfigError> {
    let name = name
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| ConfigError::Invalid {
            path: path.to_owned(),
            reason: format!("engine names must be strings, got {name:?}"),
        })?;
    let err = |reason: &str| ConfigError::Engine {
        path: path.to_owned(),
        name: name.clone(),
        reason: reason.into(),
    };
    let valid_name = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !valid_name {
        return Err(err("names may use letters, digits, `-` and `_` only"));
    }
    if !section.is_mapping() {
        return Err(err("expected a mapping such as `{ kind: batched }`"));
    }
    let kind = match section.get("kind") {
        Some(Value::String(kind)) if !kind.is_empty() => kind.clone(),
        Some(_) => return Err(err("`kind` must be a non-empty string")),
        None => {
            return Err(err(
                "missing `kind` (the plugin to load, e.g. `kind: batched`)",
            ))
        }
    };
    Ok(EngineSpec {
        name,
        kind,
        section: section.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(
            text,
            Path::new("/etc/gw/config.yaml"),
            &Overrides::default(),
        )
    }

    #[test]
    fn resolves_paths_and_keeps_engine_order() {
        let c = parse(
            "model: { path: models/m }\nplugins: [p/libx.so, /abs/liby.so]\nengines:\n  zeta: { kind: batched, max_batch: 8 }\n  alpha: { kind: fastpath }\npolicy: { default: zeta }\n",
        )
        .unwrap();
        assert_eq!(c.model.path, PathBuf::from("/etc/gw/models/m"));
        assert_eq!(
            c.plugins,
            vec![
                PathBuf::from("/etc/gw/p/libx.so"),
                PathBuf::from("/abs/liby.so")
            ]
        );
        let names: Vec<_> = c.engines.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["zeta", "alpha"]);
        assert_eq!(
            c.engines[0]
                .section
                .get("max_batch")
                .and_then(Value::as_u64),
            Some(8)
        );
        assert_eq!(c.server.port, 8000);
    }

    #[test]
    fn overrides_win() {
        let o = Overrides {
            model: Some("/m2".into()),
            port: Some(0),
            host: Some("0.0.0.0".parse().unwrap()),
        };
        let c = Config::parse(
            "model: { path: m }\nengines: { a: { kind: k } }\n",
            Path::new("c.yaml"),
            &o,
        )
        .unwrap();
        assert_eq!(c.model.path, PathBuf::from("/m2"));
        assert_eq!(c.server.port, 0);
        assert_eq!(c.server.host.to_string(), "0.0.0.0");
    }

    #[test]
    fn rejects_bad_engines_and_typos() {
        let e = parse("model: { path: m }\nengines: { a: { max_batch: 1 } }\n").unwrap_err();
        assert!(e.to_string().contains("engine `a`: missing `kind`"), "{e}");
        let e = parse("model: { path: m }\nengines: { 'a b': { kind: x } }\n").unwrap_err();
        assert!(e.to_string().contains("letters, digits"), "{e}");
        let e = parse("model: { path: m }\nengine: { a: { kind: x } }\n").unwrap_err();
        assert!(e.to_string().contains("unknown field `engine`"), "{e}");
        let e = parse("model: { path: m }\nserver: { prot: 1 }\nengines: { a: { kind: x } }\n")
            .unwrap_err();
        assert!(e.to_string().contains("unknown field `prot`"), "{e}");
        let e = parse("model: { path: m }\n").unwrap_err();
        assert!(e.to_string().contains("names no engine"), "{e}");
    }

    /// The repository's default config.yaml parses, and its policy routes
    /// the way the measurements suggest.
    #[test]
    fn shipped_config_routes_as_documented() {
        let text = include_str!("../../config.yaml");
        let c = Config::parse(text, Path::new("/repo/config.yaml"), &Overrides::default()).unwrap();
        assert_eq!(
            c.model.path,
            PathBuf::from("/repo/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
        );
        let kinds: Vec<_> = c
            .engines
            .iter()
            .map(|e| (e.name.as_str(), e.kind.as_str()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("batched", "batched"),
                ("fastpath", "fastpath"),
                ("lookup", "dflash")
            ]
        );
        assert_eq!(c.model.generation_config, GenerationConfig::Auto);
        let policy =
            policies::Policy::from_config_yaml(text, &["batched", "fastpath", "lookup"]).unwrap();
        let signals = |f: &dyn Fn(&mut policies::Signals)| {
            let mut s = policies::Signals {
                prompt_tokens: 20,
                max_tokens: 100,
                greedy: true,
                ..Default::default()
            };
            f(&mut s);
            s
        };
        let route = |s: policies::Signals| {
            let d = policy.decide(&s);
            (d.engine.to_owned(), d.rule.to_owned())
        };
        // Alone: prompt lookup while its drafts are accepted (unknown counts
        // as accepted); then the fast path, greedy or sampled.
        let rate = |r: f64| {
            move |s: &mut policies::Signals| {
                s.engine_accept_rate.insert("lookup".into(), r);
            }
        };
        for greedy in [true, false] {
            let alone = |f: &dyn Fn(&mut policies::Signals)| {
                route(signals(&|s| {
                    s.greedy = greedy;
                    f(s)
                }))
            };
            assert_eq!(
                alone(&|_| {}),
                ("lookup".into(), "speculate-while-it-pays".into())
            );
            assert_eq!(
                alone(&rate(0.6)),
                ("lookup".into(), "speculate-while-it-pays".into())
            );
        }
        for greedy in [true, false] {
            assert_eq!(
                route(signals(&|s| {
                    rate(0.1)(s);
                    s.greedy = greedy
                })),
                ("fastpath".into(), "alone".into())
            );
        }
        assert_eq!(route(signals(&|s| s.prompt_tokens = 9000)).0, "batched");
        assert_eq!(route(signals(&|s| s.kv_pressure = 0.9)).0, "batched");
        assert_eq!(
            route(signals(&|s| s.total_active = 1)),
            ("batched".into(), "busy".into())
        );
        assert_eq!(
            route(signals(&|s| s.total_queued = 2)),
            ("batched".into(), "busy".into())
        );
    }

    #[test]
    fn api_keys_from_file_and_env() {
        std::env::set_var("GW_TEST_KEYS_1", " k2 ,, k3");
        let c = parse("model: { path: m }\nserver: { api_keys: [k1, ''], api_keys_env: GW_TEST_KEYS_1 }\nengines: { a: { kind: x } }\n").unwrap();
        assert_eq!(c.api_keys(), ["k1", "k2", "k3"]);
    }
}
