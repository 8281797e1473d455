//! The mtp engine: the shared speculative engine with an assistant drafter
//! (or prompt lookup), speculating only while the batch is small.

use std::sync::Arc;

use engine_core::EngineContext;
use runtime::SharedModel;
use speculative::engine::DraftPlan;
use speculative::{DraftChoice, DraftSource, SpecEngine, SpecSettings};

use crate::assistant::Assistant;
use crate::checkpoint::AssistantConfig;

const MAX_CONCURRENT: usize = 8;
/// Speculate while at most this many sequences run; plain decode above.
const MAX_BATCH: usize = 2;
/// Tokens drafted per round (the Gemma 4 assistants' usual setting).
const DRAFT_TOKENS: usize = 3;

pub fn engine_from_context(ctx: EngineContext) -> Result<SpecEngine, String> {
    let (shared, settings) = speculative::engine::from_context(
        &ctx,
        "mtp",
        SpecSettings::defaults(MAX_CONCURRENT, Some(MAX_BATCH)),
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
            let dir = settings.drafter.clone().expect("checked by SpecSettings");
            AssistantConfig::load(&dir, &shared.model.model.config)
                .map_err(|e| format!("{name}: {e:#}"))?;
            let k = settings.draft_tokens.unwrap_or(DRAFT_TOKENS);
            DraftPlan {
                max_draft: k,
                kv_bytes_per_token: 0,
                loader: Box::new(move |model| {
                    Ok(Arc::new(Assistant::load(&dir, &model.model, k)?) as Arc<dyn DraftSource>)
                }),
            }
        }
    };
    SpecEngine::new(name, shared, settings, plan)
}
