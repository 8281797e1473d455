//! Command-line interface.

use std::net::IpAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

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
    /// Write a small random-weight model in the Hugging Face layout.
    MakeTinyModel(MakeTinyArgs),
    /// Write a random-weight speculative drafter for a target model, in the
    /// published checkpoint layout of its kind.
    MakeTinyDrafter(MakeTinyDrafterArgs),
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

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum FamilyArg {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
    /// Gemma 3 with a vision tower (`Gemma3ForConditionalGeneration`);
    /// tiny preset, unquantized.
    Gemma3Vision,
    /// Gemma 4 shaped like 26B-A4B: experts beside every MLP, K=V global
    /// layers (mlx-community layout).
    Gemma4,
    /// Gemma 4 shaped like E2B/E4B: per-layer inputs, KV-shared layers
    /// (Hugging Face layout).
    #[value(name = "gemma4-e2b")]
    Gemma4E2b,
    /// Gemma 4 shaped like 31B: dense, K=V global layers (Hugging Face
    /// multimodal layout, text only).
    #[value(name = "gemma4-dense")]
    Gemma4Dense,
    /// The 31B-like shape with a vision tower
    /// (`Gemma4ForConditionalGeneration`, Hugging Face layout); tiny preset,
    /// unquantized.
    #[value(name = "gemma4-vision")]
    Gemma4Vision,
    /// Qwen3 MoE shaped like 30B-A3B: experts in place of every MLP
    /// (Hugging Face layout, one tensor set per expert).
    #[value(name = "qwen3-moe")]
    Qwen3Moe,
    /// Qwen 3.5 dense: Gated DeltaNet layers between gated full-attention
    /// ones (Hugging Face multimodal layout, text only).
    #[value(name = "qwen3.5")]
    Qwen35,
    /// Qwen 3.5 MoE: the hybrid layers with experts and a shared expert.
    #[value(name = "qwen3.5-moe")]
    Qwen35Moe,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum PresetArg {
    /// A few hundred thousand parameters: tests.
    Tiny,
    /// About 100M parameters: CPU benchmarks.
    Bench,
    /// The shape of Qwen3-4B in bf16 (qwen3 only).
    #[value(name = "qwen3-4b")]
    Qwen3_4b,
    /// The shape of Qwen3.5-4B in bf16 (hybrid; family qwen3.5).
    #[value(name = "qwen3.5-4b")]
    Qwen35_4b,
    /// The shape of Qwen3-30B-A3B, 4-bit (family qwen3-moe).
    #[value(name = "qwen3-30b-a3b")]
    Qwen3_30bA3b,
    /// The shape of Gemma 4 26B-A4B, 4-bit (family gemma4).
    #[value(name = "gemma4-26b-a4b")]
    Gemma4_26bA4b,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum DtypeArg {
    F32,
    Bf16,
    F16,
}

#[derive(Debug, clap::Args)]
pub struct MakeTinyArgs {
    #[arg(long, value_enum)]
    pub family: FamilyArg,
    /// Directory to write (created if needed).
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, value_enum, default_value = "tiny")]
    pub preset: PresetArg,
    /// MLX affine quantization of linears and embeddings.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(["4", "8"]))]
    pub quant_bits: Option<String>,
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The context window written to config.json (`max_position_embeddings`).
    #[arg(long)]
    pub context: Option<i32>,
    /// Qwen 3.5: ship a multi-token-prediction head of this many layers
    /// (`mtp.*`, for the mtp engine's `draft: checkpoint`).
    #[arg(long, default_value_t = 0)]
    pub mtp_layers: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DrafterKind {
    /// Block-diffusion drafter (`DFlashDraftModel`).
    Dflash,
    /// Gemma-4-style assistant drafter (`Gemma4AssistantForCausalLM`).
    Mtp,
}

#[derive(Debug, clap::Args)]
pub struct MakeTinyDrafterArgs {
    #[arg(long, value_enum)]
    pub kind: DrafterKind,
    /// The target model directory the drafter is made for.
    #[arg(long)]
    pub target: PathBuf,
    /// Directory to write (created if needed).
    #[arg(long)]
    pub out: PathBuf,
    /// Drafter layers.
    #[arg(long, default_value_t = 2)]
    pub layers: i32,
    /// DFlash: tokens per block (the newest token plus block_size - 1 drafts).
    #[arg(long, default_value_t = 8)]
    pub block_size: usize,
    /// MTP: the assistant's hidden size.
    #[arg(long, default_value_t = 64)]
    pub hidden: i32,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}
