//! `gateway`: an OpenAI-compatible inference gateway over MLX that loads
//! engine plugins over one shared copy of a model and routes each request
//! by a YAML policy.

mod api;
mod cli;
mod config;
mod generation;
mod host;
mod layers;
mod make_tiny;
mod pipeline;
mod router;
mod server;
mod state;
mod telemetry;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let dispatch = telemetry::init_tracing();
    let result = match cli.command {
        Command::MakeTinyModel(args) => make_tiny::run(&args),
        Command::Serve(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(server::serve(args, dispatch))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
