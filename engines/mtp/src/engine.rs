//! The mtp engine: the shared speculative engine with an assistant drafter,
//! the checkpoint's own MTP head or prompt lookup.

use std::sync::Arc;

use engine_core::EngineContext;
use runtime::model::MtpHead;
use runtime::SharedModel;
use speculative::engine::DraftPlan;
use speculative::{DraftChoice, DraftSource, SpecEngine, SpecSettings};

use crate::assistant::Assistant;
use crate::checkpoint::AssistantConfig;
use crate::checkpoint_head::CheckpointHead;

const MAX_CONCURRENT: usize = 8;
/// Tokens drafted per round (the Gemma 4 assistants' usual setting).
const DRAFT_TOKENS: usize = 3;

pub fn engine_from_context(ctx: EngineContext) -> Result<SpecEngine, String> {
    let defaults = SpecSettings::defaults(MAX_CONCURRENT, None);
    speculative::engine::from_context(ctx, "mtp", defaults, new_engine)
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
        DraftChoice::Checkpoint => {
            let target = &shared.model.model;
            // Checked now even when the weights load lazily, so a checkpoint
            // without a head fails at startup.
            if target
                .config
                .hybrid
                .as_ref()
                .is_none_or(|h| h.mtp_layers == 0)
            {
                return Err(format!(
                    "{name}: `draft: checkpoint` needs a checkpoint with an MTP head; {} declares none (no mtp_num_hidden_layers: only Qwen 3.5 ships one)",
                    shared.model.dir.display()
                ));
            }
            let k = settings
                .draft_tokens
                .unwrap_or_else(|| CheckpointHead::default_draft_tokens(target));
            DraftPlan {
                max_draft: k,
                kv_bytes_per_token: MtpHead::kv_bytes_per_token(target),
                loader: Box::new(move |model| {
                    Ok(Arc::new(CheckpointHead::load(&model.model, &model.dir, k)?)
                        as Arc<dyn DraftSource>)
                }),
            }
        }
    };
    SpecEngine::new(name, shared, settings, plan)
}
