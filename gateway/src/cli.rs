//! Command-line interface.

use std::net::IpAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "gateway",
    version,
    about = "OpenAI-compatible inference gateway over MLX with pluggable engines"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Load the model and engines named in the config and serve the API.
    Serve(ServeArgs),
    /// Try a routing policy before it ships (the engines load for their
    /// capabilities; nothing is served).
    #[command(subcommand)]
    Policy(PolicyCommand),
}

#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Print a request's signals, each rule's verdict and the engine chosen.
    Explain {
        #[arg(long, default_value = "config.yaml")]
        config: PathBuf,
        /// An API request body (JSON: chat, completions or responses), with
        /// an optional `signals` object for live load and overrides.
        #[arg(long)]
        request: PathBuf,
    },
    /// Check the routes a file of cases expects; exits non-zero on a
    /// mismatch.
    Test {
        #[arg(long, default_value = "config.yaml")]
        config: PathBuf,
        /// YAML: `cases:`, each with `name`, `signals`, `engine` and
        /// optionally `rule`.
        #[arg(long)]
        cases: PathBuf,
    },
}

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The gateway configuration (model, engines, server, policy).
    #[arg(long, default_value = "config.yaml")]
    pub config: PathBuf,
    /// Serve this model directory instead of the config's `model.path`.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Listen on this port instead of the config's (0 picks a free one).
    #[arg(long)]
    pub port: Option<u16>,
    /// Listen on this address instead of the config's.
    #[arg(long)]
    pub host: Option<IpAddr>,
}
