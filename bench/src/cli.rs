//! Command-line interface.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::request::Endpoint;
use crate::table::Ratio;

#[derive(Debug, Parser)]
#[command(
    name = "bench",
    version,
    about = "Serving benchmark for any OpenAI-compatible endpoint"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Sweep concurrency levels against one server; write JSON (and an SVG).
    Run(RunArgs),
    /// Compare result files: one SVG, and markdown tables on stdout.
    Plot(PlotArgs),
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Base URL of the server (plain http), without `/v1`.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// The `model` field; default: the first model of GET /v1/models, or
    /// none when the server does not list any.
    #[arg(long)]
    pub model: Option<String>,
    /// Names the run in plots and tables (default: the URL).
    #[arg(long)]
    pub label: Option<String>,
    /// Concurrency levels, in order.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    pub concurrency: Vec<usize>,
    /// Requests per level (overrides --rounds).
    #[arg(long, conflicts_with = "duration_s")]
    pub requests: Option<usize>,
    /// Requests per client per level (c x rounds, at least --min-requests).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    #[arg(long, default_value_t = 4)]
    pub min_requests: usize,
    /// Seconds per level instead of a request count (clients start new
    /// requests until then; running ones finish).
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// `random` (seeded random words), `mixed` (the bundled prose, code,
    /// JSON, math and tool-call prompts) or a JSONL file of
    /// {"kind", "prompt", "tools"?}.
    #[arg(long, default_value = "random")]
    pub prompts: String,
    /// Random prompts: mean length in words (tokens per word depend on the
    /// tokenizer; results record the prompt tokens the server counted).
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Random prompts: lengths uniform in input-len x (1 +- jitter).
    #[arg(long, default_value_t = 0.25)]
    pub input_jitter: f64,
    /// max_tokens of every request.
    #[arg(long, default_value_t = 64)]
    pub output_len: u32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Index of the first prompt: a sweep split over several runs
    /// continues where the last one stopped, so no prompt repeats.
    #[arg(long, default_value_t = 0)]
    pub first_prompt: usize,
    /// Default: completions for random prompts, chat for the others.
    #[arg(long, value_enum)]
    pub endpoint: Option<Endpoint>,
    /// Send `ignore_eos: true` (servers that do not know it ignore it;
    /// throughput is computed from the tokens actually generated).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Do not send the tool-call prompts' `tools`.
    #[arg(long)]
    pub no_tools: bool,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Give request i of the sweep (its prompt index) the sampling seed
    /// BASE + i, so every server given the same sweep samples the same
    /// requests, and engines that draw alike write the same texts.
    #[arg(long, value_name = "BASE")]
    pub request_seeds: Option<u64>,
    /// Unmeasured warm-up requests: one batch at each of these
    /// concurrencies (0: none).
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub warmup: Vec<usize>,
    /// Per-request limit, seconds.
    #[arg(long, default_value_t = 600.0)]
    pub timeout_s: f64,
    /// The JSON result file.
    #[arg(long)]
    pub out: PathBuf,
    /// Also draw this run alone into an SVG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// Result files written by `bench run`, in legend order.
    #[arg(required = true)]
    pub results: Vec<PathBuf>,
    /// The SVG to write.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value = "Serving benchmark")]
    pub title: String,
    /// Ratio columns: LABEL/LABEL, or LABEL/LABEL1|LABEL2 for the best of
    /// several (repeatable).
    #[arg(long)]
    pub ratio: Vec<Ratio>,
    /// Also write the markdown tables here.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}
