//! DFlash: a block-diffusion drafter. It reads hidden states of chosen
//! target layers, fills a block `[last, mask, mask, ...]` in one forward
//! (bidirectional attention inside the block, the context's projected
//! hidden states as extra keys), and the target verifies the block in one
//! forward. Checkpoints use the published layout (`DFlashDraftModel`:
//! `fc`, `hidden_norm`, `layers.N.*`, `norm`; `block_size`,
//! `dflash_config.{target_layer_ids, mask_token_id}`), sharing the target's
//! embeddings and output head. Layers declared `sliding_attention` see only
//! recent context, as mlx-vlm's drafter does.

mod checkpoint;
mod drafter;
mod engine;

pub use checkpoint::DflashConfig;
pub use drafter::{Dflash, State as DflashState};
pub use engine::{engine_from_context, new_engine};
