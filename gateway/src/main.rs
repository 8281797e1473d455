//! `gateway`: an OpenAI-compatible inference gateway over MLX that loads
//! engine plugins over one shared copy of a model and routes each request
//! by a YAML policy.

use std::process::ExitCode;

use clap::Parser;

use gateway::cli::{Cli, Command, PolicyCommand};
use gateway::{policy_cli, server, telemetry};

fn main() -> ExitCode {
    runtime::cuda_env::apply_defaults();
    let cli = Cli::parse();
    // The policy tools build the engines for their capabilities; their
    // startup lines would bury the report.
    let quiet = matches!(cli.command, Command::Policy(_));
    telemetry::init_tracing(if quiet { "warn" } else { "info" });
    let result = match cli.command {
        Command::Policy(PolicyCommand::Explain { config, request }) => {
            policy_cli::explain(&config, &request)
        }
        Command::Policy(PolicyCommand::Test { config, cases }) => {
            match policy_cli::test(&config, &cases) {
                Ok(true) => Ok(()),
                Ok(false) => return ExitCode::FAILURE,
                Err(e) => Err(e),
            }
        }
        Command::Serve(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(server::serve(args))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
