//! Hot reload: the current policy behind an atomic pointer, replaced only by
//! a policy that validated, so a bad edit never takes routing down.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::compile::DEFAULT_RULE;
use crate::error::PolicyError;
use crate::policy::{Decision, Policy};
use crate::signals::Signals;

/// The policy in force, what it was loaded from, and how often each of
/// its rules has decided since.
pub struct ActivePolicy {
    policy: Arc<Policy>,
    /// The `policy:` section it was built from.
    pub section: serde_yaml::Value,
    /// A hash of the section (16 hex digits): equal sections, equal hashes.
    pub hash: String,
    pub loaded_at: SystemTime,
    /// Per rule in order, then the default.
    hits: Box<[AtomicU64]>,
}

/// One rule of the active policy and how often it decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleHits {
    pub rule: String,
    pub route: String,
    pub hits: u64,
}

/// A reload that was refused, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub at: SystemTime,
    pub error: String,
}

impl ActivePolicy {
    fn new(policy: Policy, section: serde_yaml::Value) -> Self {
        let text = serde_yaml::to_string(&section).unwrap_or_default();
        let hits = (0..=policy.rule_count())
            .map(|_| AtomicU64::new(0))
            .collect();
        ActivePolicy {
            policy: Arc::new(policy),
            hash: format!("{:016x}", hash(&text)),
            section,
            loaded_at: SystemTime::now(),
            hits,
        }
    }

    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }

    /// [`Policy::decide`], counted as a hit of the deciding rule.
    pub fn decide(&self, signals: &Signals) -> Decision<'_> {
        self.decide_where(signals, |_| true)
    }

    /// [`Policy::decide_where`], counted as a hit of the deciding rule.
    pub fn decide_where(&self, signals: &Signals, takes: impl Fn(&str) -> bool) -> Decision<'_> {
        let d = self.policy.decide_where(signals, takes);
        let slot = d.index.unwrap_or(self.hits.len() - 1);
        self.hits[slot].fetch_add(1, Ordering::Relaxed);
        d
    }

    /// Every rule with its route and hits, the default last.
    pub fn hits(&self) -> Vec<RuleHits> {
        let routes = self.policy.routes().chain(std::iter::once((
            DEFAULT_RULE,
            self.policy.default_engine(),
        )));
        routes
            .zip(self.hits.iter())
            .map(|((rule, route), hits)| RuleHits {
                rule: rule.to_owned(),
                route: route.to_owned(),
                hits: hits.load(Ordering::Relaxed),
            })
            .collect()
    }
}

/// A shared, swappable [`Policy`]. Cheap to clone; readers never block on
/// a reload. Files are read as gateway configs: only `policy:` is used.
#[derive(Clone)]
pub struct PolicyHandle {
    inner: Arc<Inner>,
}

struct Inner {
    current: ArcSwap<ActivePolicy>,
    rejected: Mutex<Option<Rejection>>,
    /// Engines are loaded once at start, so every reload validates against
    /// the same set.
    loaded_engines: Vec<String>,
}

impl PolicyHandle {
    /// `section` is the `policy:` section `policy` was built from.
    pub fn new(policy: Policy, section: serde_yaml::Value, loaded_engines: &[&str]) -> Self {
        let inner = Inner {
            current: ArcSwap::from_pointee(ActivePolicy::new(policy, section)),
            rejected: Mutex::new(None),
            loaded_engines: loaded_engines.iter().map(|e| (*e).to_owned()).collect(),
        };
        PolicyHandle {
            inner: Arc::new(inner),
        }
    }

    /// Loads the initial policy; unlike a reload, failure here is fatal to
    /// the caller.
    pub fn from_file(path: impl AsRef<Path>, loaded_engines: &[&str]) -> Result<Self, PolicyError> {
        let text = read(path.as_ref())?;
        let (policy, section) = build(&text, loaded_engines)?;
        Ok(PolicyHandle::new(policy, section, loaded_engines))
    }

    /// The policy in force now. Hold the `Arc` for the length of one
    /// decision; a reload meanwhile does not affect it.
    pub fn current(&self) -> Arc<Policy> {
        self.inner.current.load().policy.clone()
    }

    /// The policy in force with its source and hit counts; decide through
    /// it to count the hit.
    pub fn active(&self) -> Arc<ActivePolicy> {
        self.inner.current.load_full()
    }

    /// The last reload refused since the policy in force was loaded.
    pub fn last_rejected(&self) -> Option<Rejection> {
        self.inner.rejected.lock().unwrap().clone()
    }

    /// Re-reads `path` and swaps the policy in if it is valid; otherwise
    /// keeps the old one and returns why. Logs either way.
    pub fn reload_from_file(&self, path: impl AsRef<Path>) -> Result<(), PolicyError> {
        let path = path.as_ref();
        let result = read(path)
            .inspect_err(|e| self.inner.reject(e))
            .and_then(|text| self.inner.install(&text));
        log_outcome(path, &result);
        result.map(drop)
    }

    /// Polls `path` every `interval` and reloads when its contents change.
    /// The file as it is now is taken as already loaded. A rejected file is
    /// logged once and not retried until it changes again. The task ends
    /// when every handle has been dropped; must be called inside a tokio
    /// runtime.
    pub fn spawn_watcher(&self, path: impl Into<PathBuf>, interval: Duration) -> JoinHandle<()> {
        let path = path.into();
        let inner = Arc::downgrade(&self.inner);
        let mut seen = Seen::now(&path);
        tokio::spawn(async move {
            // tokio panics on a zero period.
            let mut ticks = tokio::time::interval(interval.max(Duration::from_millis(1)));
            ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
            ticks.tick().await; // the first tick is immediate
            loop {
                ticks.tick().await;
                let Some(inner) = Weak::upgrade(&inner) else {
                    return;
                };
                seen.poll(&path, &inner).await;
            }
        })
    }
}

impl Inner {
    /// Swaps in the policy `text` holds, or keeps the current one and
    /// records why not.
    fn install(&self, text: &str) -> Result<usize, PolicyError> {
        let loaded: Vec<&str> = self.loaded_engines.iter().map(String::as_str).collect();
        match build(text, &loaded) {
            Ok((policy, section)) => {
                let rules = policy.rule_count();
                self.current
                    .store(Arc::new(ActivePolicy::new(policy, section)));
                *self.rejected.lock().unwrap() = None;
                Ok(rules)
            }
            Err(e) => {
                self.reject(&e);
                Err(e)
            }
        }
    }

    fn reject(&self, e: &PolicyError) {
        *self.rejected.lock().unwrap() = Some(Rejection {
            at: SystemTime::now(),
            error: e.to_string(),
        });
    }
}

/// The policy a whole gateway config holds, and its `policy:` section.
fn build(text: &str, loaded: &[&str]) -> Result<(Policy, serde_yaml::Value), PolicyError> {
    let config: serde_yaml::Value = serde_yaml::from_str(text)?;
    let policy = Policy::from_config_value(&config, loaded)?;
    Ok((policy, config["policy"].clone()))
}

/// What the watcher last saw of the file. The mtime and length are cheap to
/// stat every tick; the content hash skips reloads when a file is touched or
/// rewritten unchanged.
#[derive(Default)]
struct Seen {
    modified: Option<SystemTime>,
    len: u64,
    hash: Option<u64>,
    /// Avoids logging a missing file on every tick.
    unreadable: bool,
}

impl Seen {
    fn now(path: &Path) -> Seen {
        let Ok(meta) = std::fs::metadata(path) else {
            return Seen::default();
        };
        let hash = std::fs::read_to_string(path).ok().map(|t| hash(&t));
        Seen {
            modified: meta.modified().ok(),
            len: meta.len(),
            hash,
            unreadable: false,
        }
    }

    async fn poll(&mut self, path: &Path, inner: &Inner) {
        let stat = tokio::fs::metadata(path).await;
        let text = match stat {
            Ok(meta) if meta.modified().ok() == self.modified && meta.len() == self.len => return,
            Ok(meta) => {
                self.modified = meta.modified().ok();
                self.len = meta.len();
                tokio::fs::read_to_string(path).await
            }
            Err(e) => Err(e),
        };
        let text = match text {
            Ok(text) => {
                self.unreadable = false;
                text
            }
            Err(source) => {
                if !self.unreadable {
                    tracing::warn!(
                        path = %path.display(),
                        error = %source,
                        "policy file unreadable; keeping the current policy"
                    );
                    inner.reject(&PolicyError::Io {
                        path: path.to_owned(),
                        source,
                    });
                }
                // Forget the fingerprint so the file is re-read once it is back.
                *self = Seen {
                    unreadable: true,
                    ..Seen::default()
                };
                return;
            }
        };
        let h = hash(&text);
        if self.hash == Some(h) {
            return;
        }
        self.hash = Some(h);
        log_outcome(path, &inner.install(&text));
    }
}

fn hash(text: &str) -> u64 {
    let mut h = DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

fn read(path: &Path) -> Result<String, PolicyError> {
    std::fs::read_to_string(path).map_err(|source| PolicyError::Io {
        path: path.to_owned(),
        source,
    })
}

fn log_outcome(path: &Path, result: &Result<usize, PolicyError>) {
    match result {
        Ok(rules) => tracing::info!(path = %path.display(), rules, "routing policy reloaded"),
        Err(e) => {
            tracing::warn!(
                path = %path.display(),
                error = %e,
                "routing policy rejected; keeping the current policy"
            )
        }
    }
}
