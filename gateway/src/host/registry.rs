//! Startup: the model is loaded once and shared, with one KV pool, by every
//! engine through the C tables of `SharedModel::export`; each `engines:`
//! entry is built from its own config section. An engine
//! whose plugin is missing, refused or fails to build is recorded and
//! logged, and the gateway carries on with the rest.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::Context;
use engine_core::plugin::export::CreateArgs;
use runtime::{KvPool, LoadedModel, SharedModel};

use super::entry::EngineEntry;
use super::memory::{self, MemoryPlan};
use super::plugins::{self, Plugin};
use crate::config::{Config, EngineSpec};

/// A configured engine that did not load, and why.
#[derive(Debug, Clone)]
pub struct FailedEngine {
    pub name: String,
    pub kind: String,
    pub error: String,
}

/// A file under `plugins:` that was refused.
#[derive(Debug, Clone)]
pub struct RefusedPlugin {
    pub path: String,
    pub error: String,
}

pub struct Registry {
    pub shared: Arc<SharedModel>,
    engines: Vec<Arc<EngineEntry>>,
    pub failed: Vec<FailedEngine>,
    pub refused_plugins: Vec<RefusedPlugin>,
    /// How `memory:` divided the budget; `None` without one.
    pub memory: Option<MemoryPlan>,
}

impl Registry {
    /// Loads the model, opens the plugins and builds every engine. Fails only
    /// when the model cannot load or no engine at all could be built.
    pub fn load(config: &Config) -> anyhow::Result<Self> {
        let (shared, memory) = load_shared(config)?;
        let shared = Arc::new(shared);
        let shared_tables = shared.export();
        let (by_kind, refused_plugins) = open_listed_plugins(config);
        let dirs = match &config.plugin_dir {
            Some(dir) => vec![dir.clone()],
            None => plugins::default_dirs(),
        };
        let mut opened: HashMap<String, Arc<Plugin>> = by_kind;
        let mut engines = Vec::new();
        let mut failed = Vec::new();
        for spec in &config.engines {
            let built = plugin_for(spec, &mut opened, &dirs).and_then(|plugin| {
                let args = CreateArgs {
                    name: spec.name.clone(),
                    config_yaml: serde_yaml::to_string(&spec.section)
                        .map_err(|e| format!("cannot encode the engine's config: {e}"))?,
                    config_dir: config
                        .path
                        .parent()
                        .map(std::path::Path::to_path_buf)
                        .unwrap_or_default(),
                    model: Some(shared.facts()),
                };
                plugin
                    .create(&args, shared_tables)
                    .map(|engine| (engine, plugin))
            });
            match built {
                Ok((engine, plugin)) => {
                    let entry = EngineEntry::new(spec.name.clone(), spec.kind.clone(), engine);
                    tracing::info!(
                        engine = %spec.name,
                        kind = %spec.kind,
                        plugin = %plugin.path.display(),
                        abi = plugin.fingerprint.abi,
                        capabilities = ?entry.capabilities,
                        "engine loaded"
                    );
                    engines.push(Arc::new(entry));
                }
                Err(error) => {
                    tracing::error!(engine = %spec.name, kind = %spec.kind, %error, "engine not loaded");
                    failed.push(FailedEngine {
                        name: spec.name.clone(),
                        kind: spec.kind.clone(),
                        error,
                    });
                }
            }
        }
        anyhow::ensure!(
            !engines.is_empty(),
            "no engine could be loaded: {}",
            failed
                .iter()
                .map(|f| format!("{}: {}", f.name, f.error))
                .collect::<Vec<_>>()
                .join("; ")
        );
        if config.model.warm_up.runs() {
            let took = super::warm::warm_engines(&engines, shared.model.vocab_size() as u32);
            tracing::info!(
                seconds = took.as_secs_f64(),
                "engines warmed (bursts of requests)"
            );
        }
        Ok(Registry {
            shared,
            engines,
            failed,
            refused_plugins,
            memory,
        })
    }

    pub fn engines(&self) -> &[Arc<EngineEntry>] {
        &self.engines
    }

    pub fn get(&self, name: &str) -> Option<&Arc<EngineEntry>> {
        self.engines.iter().find(|e| e.name == name)
    }

    pub fn names(&self) -> Vec<&str> {
        self.engines.iter().map(|e| e.name.as_str()).collect()
    }

    /// Every engine config.yaml names, loaded or not: what a policy may
    /// route to (one that failed to load is skipped like one out of
    /// service).
    pub fn configured_names(&self) -> Vec<&str> {
        self.names()
            .into_iter()
            .chain(self.failed.iter().map(|f| f.name.as_str()))
            .collect()
    }

    /// Stops every engine; each returns once its in-flight work has stopped.
    pub fn shutdown(&self) {
        for entry in &self.engines {
            entry.shutdown();
        }
    }
}

/// Without a `memory:` budget, the KV pool's default size.
const DEFAULT_KV_CACHE_MB: usize = 1024;

fn load_shared(config: &Config) -> anyhow::Result<(SharedModel, Option<MemoryPlan>)> {
    let m = &config.model;
    let mut model = LoadedModel::load_as(&m.path, m.name.as_deref(), m.compute_dtype)
        .with_context(|| format!("loading the model from {}", m.path.display()))?;
    model.model.set_kv_quant(m.kv_cache)?;
    let per_token = model.model.kv_bytes_per_token();
    let kv_cap = m.kv_cache_mb.map(|mb| (mb as u64) << 20);
    let plan = match &config.memory {
        Some(budget) => {
            // The smallest useful pool holds one step's tokens.
            let min_kv = (per_token * budget.step_tokens) as u64;
            Some(memory::plan(budget, &model, kv_cap, min_kv)?)
        }
        None => None,
    };
    let kv_bytes = match plan {
        Some(p) => p.kv_pool,
        None => {
            let kv_bytes = (m.kv_cache_mb.unwrap_or(DEFAULT_KV_CACHE_MB) as u64) << 20;
            let weights = runtime::memory::mlx_memory().active;
            memory::check_free(weights, kv_bytes, (per_token * m.kv_block_size) as u64)?;
            kv_bytes
        }
    };
    let kv_pool = KvPool::with_budget(kv_bytes as usize, m.kv_block_size, per_token)
        .with_sequence_state(model.model.state_bytes_per_sequence())
        .with_step_tokens(config.memory.as_ref().map(|b| b.step_tokens));
    anyhow::ensure!(
        kv_pool.total() > 0,
        "the KV pool ({}) holds no KV block of {} bytes; raise model.kv_cache_mb (or the memory budget)",
        runtime::memory::mib(kv_bytes),
        per_token * m.kv_block_size
    );
    tracing::info!(
        blocks = kv_pool.total(),
        block_size = kv_pool.block_size(),
        tokens = kv_pool.total() * kv_pool.block_size(),
        bytes_per_token = per_token,
        kv_cache = %m.kv_cache.map_or_else(|| "model dtype".to_string(), |q| format!("{} bits, group {}", q.bits, q.group_size)),
        state_blocks_per_sequence = kv_pool.state_blocks(),
        "shared KV pool ready"
    );
    let shared = SharedModel::with_layout(model, kv_pool, m.prefix_cache_entries, m.kv_layout)?;
    if let Some(pages) = shared.pages() {
        runtime::generate::preallocate(&shared.model.model, pages)
            .context("allocating the paged KV pool")?;
        tracing::info!(
            blocks = pages.usable(),
            block_size = pages.block(),
            mib = pages.nbytes() >> 20,
            "paged KV pool allocated"
        );
    }
    if !config.model.warm_up.runs() {
        return Ok((shared, plan));
    }
    let warm = runtime::generate::warm_up(&shared.model.model, shared.prefill_chunk(), || {
        shared.new_cache(vec![0])
    })
    .context("warming up the model's forward shapes")?;
    if !warm.is_zero() {
        tracing::info!(
            seconds = warm.as_secs_f64(),
            "forward shapes built (prefill widths, decode lengths)"
        );
    }
    Ok((shared, plan))
}

/// Opens every file under `plugins:`, keyed by the kind it reports. A
/// refused file is logged and skipped.
fn open_listed_plugins(config: &Config) -> (HashMap<String, Arc<Plugin>>, Vec<RefusedPlugin>) {
    let mut by_kind = HashMap::new();
    let mut refused = Vec::new();
    for path in &config.plugins {
        match Plugin::open(path) {
            Ok(plugin) => {
                tracing::info!(path = %path.display(), kind = %plugin.kind, "plugin opened");
                if by_kind.contains_key(&plugin.kind) {
                    tracing::warn!(path = %path.display(), kind = %plugin.kind, "another plugin already provides this kind; ignoring this one");
                    continue;
                }
                by_kind.insert(plugin.kind.clone(), Arc::new(plugin));
            }
            Err(e) => {
                tracing::error!(error = %e, "plugin refused");
                refused.push(RefusedPlugin {
                    path: path.display().to_string(),
                    error: e.to_string(),
                });
            }
        }
    }
    (by_kind, refused)
}

/// The plugin providing `spec.kind`: one listed under `plugins:`, else
/// `libengine_<kind>` from the plugin directory.
fn plugin_for(
    spec: &EngineSpec,
    opened: &mut HashMap<String, Arc<Plugin>>,
    dirs: &[std::path::PathBuf],
) -> Result<Arc<Plugin>, String> {
    if let Some(plugin) = opened.get(&spec.kind) {
        return Ok(plugin.clone());
    }
    let path = plugins::find(&spec.kind, dirs).ok_or_else(|| {
        format!(
            "no plugin for kind `{}`: {} not found in {} (build it, or list its path under `plugins:`)",
            spec.kind,
            plugins::file_name(&spec.kind),
            dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
        )
    })?;
    let plugin = Plugin::open(&path).map_err(|e| e.to_string())?;
    if plugin.kind != spec.kind {
        return Err(format!(
            "{} provides kind `{}`, not `{}`",
            path.display(),
            plugin.kind,
            spec.kind
        ));
    }
    let plugin = Arc::new(plugin);
    opened.insert(spec.kind.clone(), plugin.clone());
    Ok(plugin)
}
