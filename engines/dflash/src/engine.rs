//! The dflash engine: the shared speculative engine with a DFlash drafter
//! (or prompt lookup).

use std::path::PathBuf;
use std::sync::Arc;

use engine_core::EngineContext;
use runtime::SharedModel;
use speculative::engine::DraftPlan;
use speculative::{DraftChoice, DraftSource, SpecEngine, SpecSettings};

use crate::checkpoint::DflashConfig;
use crate::drafter::Dflash;

/// `max_concurrent` default: DFlash gains at 1-2 requests, breaks even near
/// 4 and loses beyond (measured elsewhere on a 26B target).
const MAX_CONCURRENT: usize = 4;

pub fn engine_from_context(ctx: EngineContext) -> Result<SpecEngine, String> {
    let (shared, settings) = speculative::engine::from_context(
        &ctx,
        "dflash",
        SpecSettings::defaults(MAX_CONCURRENT, None),
    )?;
    new_engine(ctx.name, shared, settings)
}

pub fn new_engine(
    name: String,
    shared: Arc<SharedModel>,
    settings: SpecSettings,
) -> Result<SpecEngine, String> {
    let plan = match settings.draft {
        DraftChoice::Ngram => DraftPlan::prompt_lookup(settings.prompt_lookup()),
        DraftChoice::Drafter => {
            let dir: PathBuf = settings.drafter.clone().expect("checked by SpecSettings");
            let target = &shared.model.model;
            // The config is checked now even when the weights load lazily,
            // so a wrong checkpoint fails at startup.
            let cfg =
                DflashConfig::load(&dir, &target.config).map_err(|e| format!("{name}: {e:#}"))?;
            let elem = if target.dtype() == mlx_rs::Dtype::Float32 {
                4
            } else {
                2
            };
            let max_draft = (cfg.block_size - 1).min(settings.draft_tokens.unwrap_or(usize::MAX));
            let limit = settings.draft_tokens;
            DraftPlan {
                max_draft,
                kv_bytes_per_token: cfg.kv_bytes_per_token(elem),
                loader: Box::new(move |model| {
                    let d = Dflash::load(&dir, &model.model)?;
                    Ok(match limit {
                        Some(k) => Arc::new(Limited(d, k)) as Arc<dyn DraftSource>,
                        None => Arc::new(d) as Arc<dyn DraftSource>,
                    })
                }),
            }
        }
    };
    SpecEngine::new(name, shared, settings, plan)
}

/// A drafter that proposes fewer tokens than its block (`draft_tokens:`).
struct Limited(Dflash, usize);

impl DraftSource for Limited {
    fn taps(&self) -> runtime::model::Taps {
        self.0.taps()
    }
    fn max_draft(&self) -> usize {
        self.0.max_draft().min(self.1)
    }
    fn kv_bytes_per_token(&self) -> usize {
        self.0.kv_bytes_per_token()
    }
    fn start(&self) -> Box<dyn speculative::DraftState> {
        self.0.start()
    }
}
