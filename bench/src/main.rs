//! `bench`: drives any OpenAI-compatible endpoint (our gateway or another
//! server) through a concurrency sweep with streaming on, and compares
//! runs in tables and plots. See bench/README.md.

mod cli;
mod client;
mod metric;
mod plot;
mod prompts;
mod record;
mod report;
mod request;
mod run;
mod stats;
mod sweep;
mod table;

use anyhow::Result;
use clap::Parser;

use cli::{Cli, Command};
use report::BenchResult;

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            let (out, plot) = (args.out.clone(), args.plot.clone());
            let result = runtime.block_on(run::run(args))?;
            result.write(&out)?;
            eprintln!("wrote {}", out.display());
            if let Some(path) = plot {
                plot::svg(std::slice::from_ref(&result), &result.label, &path)?;
                eprintln!("wrote {}", path.display());
            }
        }
        Command::Plot(args) => {
            let results = args
                .results
                .iter()
                .map(|p| BenchResult::read(p))
                .collect::<Result<Vec<_>>>()?;
            plot::svg(&results, &args.title, &args.out)?;
            let tables = table::markdown(&results, &args.ratio);
            if let Some(path) = &args.markdown {
                std::fs::write(path, &tables)?;
            }
            print!("{tables}");
        }
    }
    Ok(())
}
