//! `gateway`: an OpenAI-compatible inference gateway over MLX that loads
//! engine plugins over one shared copy of a model and routes each request
//! by a YAML policy.
//!
//! The library holds everything; `main.rs` is the command line. It is a
//! library so the fuzz targets (`fuzz/`) can reach the request parsers.

pub mod api;
pub mod cli;
pub mod config;
pub mod generation;
pub mod host;
pub mod layers;
pub mod pipeline;
pub mod policy_cli;
pub mod prepare;
pub mod protocol;
pub mod router;
pub mod server;
pub mod state;
pub mod telemetry;
pub mod vision;
