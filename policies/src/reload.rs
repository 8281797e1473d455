//! Hot reload: the current policy behind an atomic pointer, replaced only by
//! a policy that validated, so a bad edit never takes routing down.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::error::PolicyError;
use crate::policy::Policy;

/// A shared, swappable [`Policy`]. Cheap to clone; readers never block on
/// a reload. Files are read as gateway configs: only `policy:` is used.
#[derive(Clone)]
pub struct PolicyHandle {
    inner: Arc<Inner>,
}

struct Inner {
    current: ArcSwap<Policy>,
    /// Engines are loaded once at start, so every reload validates against
    /// the same set.
    loaded_engines: Vec<String>,
}

impl PolicyHandle {
    pub fn new(policy: Policy, loaded_engines: &[&str]) -> Self {
        let inner = Inner {
            current: ArcSwap::from_pointee(policy),
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
        Ok(PolicyHandle::new(
            Policy::from_config_yaml(&text, loaded_engines)?,
            loaded_engines,
        ))
    }

    /// The policy in force now. Hold the `Arc` for the length of one
    /// decision; a reload meanwhile does not affect it.
    pub fn current(&self) -> Arc<Policy> {
        self.inner.current.load_full()
    }

    /// Re-reads `path` and swaps the policy in if it is valid; otherwise
    /// keeps the old one and returns why. Logs either way.
    pub fn reload_from_file(&self, path: impl AsRef<Path>) -> Result<(), PolicyError> {
        let path = path.as_ref();
        let result = read(path).and_then(|text| self.inner.install(&text));
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
    fn install(&self, text: &str) -> Result<usize, PolicyError> {
        let loaded: Vec<&str> = self.loaded_engines.iter().map(String::as_str).collect();
        let policy = Policy::from_config_yaml(text, &loaded)?;
        let rules = policy.rule_count();
        self.current.store(Arc::new(policy));
        Ok(rules)
    }
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
