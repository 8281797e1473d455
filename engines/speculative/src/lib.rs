//! What the speculative engines (`dflash`, `mtp`) share.
//!
//! A [`DraftSource`] proposes the next few tokens of a sequence; the target
//! model checks them all in one forward pass and the [`decode`] loop keeps
//! the longest prefix the target agrees with plus the target's own next
//! token, rolling the KV cache back over the rest. The target's choice at
//! each position is plain decoding's (its argmax, or the request's sampler
//! with plain sampling's key there), so the output is exactly what plain
//! decoding gives, greedy or sampled with a seed, whatever the drafter
//! proposes: a bad drafter costs speed, never correctness.
//!
//! The [`engine`] runs its sequences on one worker thread, verifying all
//! their drafts together in one batched forward per round, and keeps
//! a moving window of acceptance ([`window`]) that the router reads as
//! `engine_accept_rate.NAME`. [`ngram`] is a draft source that needs no
//! drafter weights (prompt lookup).

pub mod adaptive;
pub mod checkpoint;
pub mod config;
pub mod decode;
pub mod draft;
pub mod engine;
pub mod ngram;
pub mod replay;
pub mod window;

pub use adaptive::{DraftSizer, RoundCost};
pub use config::{DraftChoice, SpecSettings};
pub use decode::Sequence;
pub use draft::{DraftSource, DraftState, Proposal};
pub use engine::{DraftPlan, SourceLoader, SpecEngine};
pub use ngram::PromptLookup;
pub use replay::Replay;
pub use window::AcceptWindow;
