//! The remote engine: one engine name in front of a pool of upstream
//! OpenAI-compatible servers (vLLM, SGLang, `mlx_lm.server`, or another
//! instance of this gateway). Requests travel as token ids where the
//! upstream can (`/v1/completions` with `return_token_ids`), as text
//! re-tokenized with the shared tokenizer where it cannot. Upstreams are
//! health-checked, balanced by requests in flight and their published
//! load, with prefix affinity; a request fails over to another upstream
//! only before its first token. No MLX here.

pub mod balance;
pub mod base_url;
mod client;
pub mod config;
mod engine;
mod forward;
mod health;
pub mod load_report;
pub mod pool;
pub mod wire;

pub use config::{Protocol, RemoteConfig};
pub use engine::{RemoteEngine, ServedModel};
