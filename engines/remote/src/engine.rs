//! The `Engine` face of the remote pool. Requests run as tasks on the
//! engine's own tokio runtime: a plugin links its own copy of tokio, whose
//! thread-local runtime context the host's worker threads never set, so
//! the host's runtime cannot drive this copy's sockets and timers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine_core::{
    Capabilities, Engine, EngineContext, EngineError, EngineLoad, EventSender, GenerateRequest,
    Refusal, RequestId,
};
use tokio::sync::Notify;

use crate::balance::BalanceRules;
use crate::client::HttpClient;
use crate::config::RemoteConfig;
use crate::forward::Forwarder;
use crate::health::Checker;
use crate::pool::{Pool, Upstream};
use crate::wire;

/// The served model as the engine uses it: its name and its own tokenizer.
pub struct ServedModel {
    /// The name this gateway serves the model under.
    pub name: String,
    pub tokenizer: Arc<text::Tokenizer>,
}

pub struct RemoteEngine {
    name: String,
    pool: Arc<Pool>,
    forwarder: Arc<Forwarder>,
    /// Cancel signals of requests in flight.
    running: Arc<Mutex<HashMap<RequestId, Arc<Notify>>>>,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
}

impl RemoteEngine {
    /// The plugin's constructor (logging is installed by `export_engine!`):
    /// the served model's name and tokenizer come in the context.
    pub fn from_context(ctx: EngineContext) -> Result<Self, String> {
        let config = RemoteConfig::from_yaml(&ctx.config)?;
        let facts = ctx
            .model
            .ok_or("remote engine: the gateway serves no model to name")?;
        // Our own tokenizer, loaded from the same files: the host's encodes
        // through its copy of the regex library (onig), whose encoding
        // tables are per-copy globals that this plugin's copy does not
        // recognise.
        let tokenizer = text::Tokenizer::load(&facts.tokenizer)
            .map_err(|e| format!("remote engine: cannot load the model's tokenizer: {e}"))?;
        let model = ServedModel {
            name: facts.name,
            tokenizer: Arc::new(tokenizer),
        };
        Self::new(ctx.name, config, model)
    }

    /// Builds the pool and checks every upstream once before returning, so
    /// the first request already knows which are up.
    pub fn new(name: String, config: RemoteConfig, model: ServedModel) -> Result<Self, String> {
        let upstreams = config
            .upstream_configs()
            .iter()
            .enumerate()
            .map(|(i, c)| Upstream::new(i, c).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("remote engine config: {e}"))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(format!("{name}-io"))
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the remote engine's runtime: {e}"))?;
        let client = HttpClient::new(config.connect_timeout());
        let pool = Arc::new(Pool::new(
            upstreams.clone(),
            BalanceRules {
                max_outstanding: config.max_outstanding_per_upstream,
                kv_high_watermark: config.kv_high_watermark,
                affinity_max_imbalance: config.affinity_max_imbalance,
            },
            config.affinity_prefix_tokens,
        ));
        let checker = Arc::new(Checker {
            client: client.clone(),
            model: model.name.clone(),
            timeout: config.health_timeout(),
            metrics_path: config.metrics_path.clone(),
        });
        first_checks(&runtime, &checker, &upstreams, config.health_timeout());
        runtime.spawn(checker.run(upstreams.clone(), config.health_interval()));
        let forwarder = Arc::new(Forwarder {
            pool: pool.clone(),
            client,
            tokenizer: model.tokenizer,
            model: model.name,
            retries: config.retries,
            first_token_timeout: config.first_token_timeout(),
            idle_timeout: config.idle_timeout(),
        });
        tracing::info!(
            engine = %name,
            upstreams = upstreams.len(),
            healthy = pool.healthy_count(),
            "remote engine ready"
        );
        Ok(RemoteEngine {
            name,
            pool,
            forwarder,
            running: Arc::new(Mutex::new(HashMap::new())),
            runtime: Mutex::new(Some(runtime)),
        })
    }

    /// Upstreams currently passing their health checks.
    pub fn healthy_upstreams(&self) -> usize {
        self.pool.healthy_count()
    }

    /// Requests in flight per upstream, in configuration order.
    pub fn outstanding_per_upstream(&self) -> Vec<usize> {
        self.pool
            .upstreams
            .iter()
            .map(|u| u.outstanding())
            .collect()
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<RequestId, Arc<Notify>>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Runs one health check of every upstream, waiting at most a little
/// longer than one check may take. A plain thread wait, not `block_on`:
/// this may be called from inside another runtime.
fn first_checks(
    runtime: &tokio::runtime::Runtime,
    checker: &Arc<Checker>,
    upstreams: &[Arc<Upstream>],
    timeout: Duration,
) {
    let (done, wait) = std::sync::mpsc::channel();
    let checker = checker.clone();
    let upstreams = upstreams.to_vec();
    runtime.spawn(async move {
        let checks: Vec<_> = upstreams
            .into_iter()
            .map(|u| {
                let checker = checker.clone();
                tokio::spawn(async move { checker.check(&u).await })
            })
            .collect();
        for c in checks {
            let _ = c.await;
        }
        let _ = done.send(());
    });
    // /v1/models, then /metrics or /health: at most three timeouts.
    let _ = wait.recv_timeout(timeout * 3 + Duration::from_millis(500));
}

impl Engine for RemoteEngine {
    fn name(&self) -> &str {
        &self.name
    }

    /// Everything textual happens in this gateway, so the pool serves
    /// every request shape its upstreams can generate for.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            greedy_only: false,
            tools: true,
            images: false,
            // Upstreams differ in what structured outputs they take.
            grammar: false,
            // The chosen tokens' (token-protocol upstreams: `wire::unsupported`).
            logprobs: true,
            exclusive: false,
        }
    }

    fn submit_to(&self, request: GenerateRequest, events: EventSender) -> Result<(), EngineError> {
        let runtime = self.runtime.lock().unwrap_or_else(|e| e.into_inner());
        let Some(runtime) = runtime.as_ref() else {
            return Err(EngineError::ShuttingDown);
        };
        // Every upstream speaks one protocol per upstream; refuse what any
        // healthy upstream could not carry, so no attempt fails on it.
        for upstream in self.pool.upstreams.iter().filter(|u| u.is_healthy()) {
            if let Some(reason) = wire::unsupported(&request, upstream.protocol) {
                return Err(Refusal::Other(reason.into()).into());
            }
        }
        // Refuse at once when no upstream can take it, so the router falls
        // back instead of the client waiting on a dead pool.
        match self.pool.healthy_count() {
            0 => return Err(Refusal::NotReady.into()),
            _ if self.pool.all_at_cap() => return Err(Refusal::Busy.into()),
            _ => {}
        }
        let cancel = Arc::new(Notify::new());
        let id = request.id;
        self.running().insert(id, cancel.clone());
        let forwarder = self.forwarder.clone();
        let running = self.running.clone();
        runtime.spawn(async move {
            forwarder.run(request, events, cancel).await;
            running
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
        });
        Ok(())
    }

    /// Wakes the request's task, which drops its upstream connection (the
    /// upstream sees a disconnect and stops generating).
    fn cancel(&self, id: RequestId) {
        if let Some(cancel) = self.running().get(&id) {
            cancel.notify_one();
        }
    }

    fn load(&self) -> EngineLoad {
        EngineLoad {
            active: self.pool.outstanding(),
            queued: self.pool.reported_waiting(),
            kv_blocks_held: 0,
            healthy: self.pool.healthy_count() > 0,
            accept_rate: None,
            expected_speedup: None,
        }
    }

    /// Cancels every request, waits briefly for their tasks to let go of
    /// their connections, then stops the runtime.
    fn shutdown(&self) {
        let Some(runtime) = self
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
        for cancel in self.running().values() {
            cancel.notify_one();
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.running().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        runtime.shutdown_background();
    }
}

impl Drop for RemoteEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
