//! What every handler shares: the config, the engines, the router and the
//! facts about the served model.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;

use engine_core::SamplingDefaults;

use crate::config::Config;
use crate::host::Registry;
use crate::protocol::options::{GenOptions, Limits};
use crate::protocol::ApiError;
use crate::router::Router;
use crate::vision::Vision;

pub struct ModelInfo {
    pub name: String,
    pub context_window: usize,
    pub vocab: usize,
    /// Unix time the gateway started serving it (`created` in /v1/models).
    pub created: u64,
    /// What a request that leaves a sampling knob out gets: the
    /// checkpoint's recommendation (`model.generation_config: auto`), or
    /// nothing (`none`: greedy, no truncation).
    pub sampling_defaults: SamplingDefaults,
}

impl ModelInfo {
    /// Fills in the sampling knobs the request leaves out.
    pub fn fill_sampling(&self, options: &mut GenOptions) {
        options.fill_sampling(&self.sampling_defaults);
    }
}

pub struct AppState {
    pub config: Config,
    pub registry: Arc<Registry>,
    pub router: Router,
    pub model: ModelInfo,
    pub metrics: PrometheusHandle,
    /// Images in requests, when the model has a vision tower.
    pub vision: Option<Vision>,
    /// Set on a shutdown signal: no new generations, /health says so.
    draining: AtomicBool,
}

impl AppState {
    pub fn new(
        config: Config,
        registry: Arc<Registry>,
        router: Router,
        metrics: PrometheusHandle,
    ) -> anyhow::Result<Self> {
        let loaded = &registry.shared.model;
        let model = ModelInfo {
            name: loaded.name.clone(),
            context_window: loaded.context_window(),
            vocab: loaded.vocab_size().max(loaded.tokenizer.vocab_size()),
            created: crate::protocol::unix_now(),
            sampling_defaults: config
                .model
                .generation_config
                .defaults(loaded.sampling_defaults),
        };
        if model.sampling_defaults != SamplingDefaults::default() {
            tracing::info!(defaults = ?model.sampling_defaults, "sampling defaults from the checkpoint (model.generation_config: auto)");
        }
        let vision = Vision::new(registry.shared.clone(), config.vision.clone())?;
        Ok(Self {
            config,
            registry,
            router,
            model,
            metrics,
            vision,
            draining: AtomicBool::new(false),
        })
    }

    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub fn limits(&self) -> Limits {
        let pool = &self.registry.shared.kv_pool;
        Limits {
            context_window: self.model.context_window,
            default_max_tokens: self.config.model.default_max_tokens,
            pool_tokens: pool.total() * pool.block_size(),
        }
    }

    /// The request's `model` must name the served model.
    pub fn check_model(&self, requested: Option<&str>) -> Result<String, ApiError> {
        match requested {
            None => Err(ApiError::invalid("`model` is required", "model")),
            Some(name) if name == self.model.name => Ok(name.to_owned()),
            Some(name) => Err(ApiError::ModelNotFound(name.to_owned())),
        }
    }
}

pub type SharedState = Arc<AppState>;
