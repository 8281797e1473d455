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
    let defaults = SpecSettings::defaults(MAX_CONCURRENT, None);
    speculative::engine::from_context(ctx, "dflash", defaults, new_engine)
}

pub fn new_engine(
    name: String,
    shared: Arc<SharedModel>,
    settings: SpecSettings,
) -> Result<SpecEngine, String> {
    let plan = match settings.draft {
        DraftChoice::Ngram => DraftPlan::prompt_lookup(settings.prompt_lookup()),
        DraftChoice::Checkpoint => {
            return Err(format!(
                "{name}: `draft: checkpoint` (the model's own MTP head) is the mtp engine's; dflash drafts with `drafter:` or `ngram`"
            ))
        }
        DraftChoice::Drafter => {
            let dir: PathBuf = settings.drafter.clone().expect("checked by SpecSettings");
            let target = &shared.model.model;
            // The config is checked now even when the weights load lazily,
            // so a wrong checkpoint fails at startup.
            let cfg =
                DflashConfig::load(&dir, &target.config).map_err(|e| format!("{name}: {e:#}"))?;
            let limit = settings.draft_tokens;
            DraftPlan {
                max_draft: (cfg.block_size - 1).min(limit.unwrap_or(usize::MAX)),
                kv_bytes_per_token: cfg.kv_bytes_per_token(target.activation_bytes()),
                loader: Box::new(move |model| {
                    Ok(Arc::new(Dflash::load(&dir, &model.model, limit)?) as Arc<dyn DraftSource>)
                }),
            }
        }
    };
    SpecEngine::new(name, shared, settings, plan)
}
