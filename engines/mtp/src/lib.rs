//! MTP: a Gemma-4-style assistant drafter, or (`draft: checkpoint`) the
//! multi-token-prediction head the target checkpoint ships itself (Qwen
//! 3.5's `mtp.*`, see [`CheckpointHead`]).
//!
//! The assistant drafter: from the target's last hidden
//! state (after its final norm) and the newest token it drafts k tokens one
//! at a time, feeding its own projected output back as the next hidden
//! state. It has no KV cache of its own: its layers compute queries only and
//! attend into the target's cache (sliding layers into the target's last
//! sliding-window layer, full layers into its last global layer), all draft
//! queries at the position of the last cached token (as the reference
//! assistants place them). The target verifies the k
//! drafts in one forward. Speculates while at most `max_batch` sequences run
//! (default 2), plain decode above.
//!
//! Checkpoint layout (`Gemma4AssistantForCausalLM`): `pre_projection`,
//! `post_projection`, `model.embed_tokens` (its own tied output head),
//! `model.norm`, `model.layers.N.{self_attn.{q_proj,o_proj,q_norm},
//! mlp.*, input_layernorm, post_attention_layernorm,
//! pre_feedforward_layernorm, post_feedforward_layernorm, layer_scalar}`.
//! With `use_ordered_embeddings` (the E2B/E4B assistants) the output head
//! is centroid-masked (`masked_embedding.{centroids.weight,
//! token_ordering}`, see masked_head.rs).

mod assistant;
mod checkpoint;
mod checkpoint_head;
mod engine;
mod masked_head;

pub use assistant::Assistant;
pub use checkpoint::{AssistantConfig, OrderedEmbeddings};
pub use checkpoint_head::CheckpointHead;
pub use engine::{engine_from_context, new_engine};
