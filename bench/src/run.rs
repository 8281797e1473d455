//! `bench run`: resolve the target, warm up, sweep, write the results.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Result};

use crate::cli::RunArgs;
use crate::client::HttpClient;
use crate::prompts::{PromptSet, RandomWords};
use crate::report::{BenchResult, Settings, SCHEMA};
use crate::request::{Endpoint, RequestShape};
use crate::sweep::{Amount, Sweep};

pub async fn run(args: RunArgs) -> Result<BenchResult> {
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        bail!("--concurrency needs levels of at least 1");
    }
    let client = HttpClient::new(&args.url, Duration::from_secs_f64(args.timeout_s))?;
    let model = match args.model.clone() {
        Some(m) => Some(m),
        None => first_model(&client).await,
    };
    let prompts = PromptSet::named(
        &args.prompts,
        RandomWords::new(args.input_len, args.input_jitter, args.seed),
    )?;
    let endpoint = args.endpoint.unwrap_or(match prompts {
        PromptSet::Random(_) => Endpoint::Completions,
        PromptSet::List(_) => Endpoint::Chat,
    });
    let amount = match (args.requests, args.duration_s) {
        (Some(n), _) => Amount::Requests(n),
        (None, Some(s)) => Amount::Duration(Duration::from_secs_f64(s)),
        (None, None) => Amount::Rounds {
            rounds: args.rounds,
            min: args.min_requests,
        },
    };
    let shape = RequestShape {
        endpoint,
        model: model.clone(),
        max_tokens: args.output_len,
        temperature: args.temperature,
        ignore_eos: args.ignore_eos,
        tools: !args.no_tools,
        seeds: args.request_seeds,
    };
    let label = args.label.clone().unwrap_or_else(|| args.url.clone());
    let settings = Settings {
        endpoint,
        model,
        prompt_set: args.prompts.clone(),
        input_words: args.input_len,
        input_jitter: args.input_jitter,
        max_tokens: args.output_len,
        ignore_eos: args.ignore_eos,
        temperature: args.temperature,
        tools: shape.tools,
        seed: args.seed,
        request_seeds: args.request_seeds,
        first_prompt: args.first_prompt,
        amount: amount.describe(),
        warmup: args.warmup.iter().copied().filter(|&c| c > 0).collect(),
    };
    let sweep = Sweep {
        client,
        shape,
        prompts: Arc::new(prompts),
        amount,
    };
    eprintln!(
        "bench {label}: {} {}, model {:?}, {}",
        args.url,
        endpoint.path(),
        settings.model,
        amount.describe()
    );
    let failures = sweep.warm_up(&settings.warmup).await;
    if !failures.is_empty() {
        eprintln!(
            "warm-up: {} request(s) failed: {failures:?}",
            failures.len()
        );
    }
    let started_unix_s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let next_prompt = Arc::new(AtomicUsize::new(args.first_prompt));
    let mut levels = Vec::new();
    for &c in &args.concurrency {
        let level = sweep.level(c, &next_prompt).await;
        eprintln!("{}", level.line());
        levels.push(level);
    }
    Ok(BenchResult {
        schema: SCHEMA.into(),
        label,
        url: args.url,
        settings,
        started_unix_s,
        levels,
    })
}

/// The first id GET /v1/models lists; `None` when the server lists none
/// (the request then leaves `model` out).
async fn first_model(client: &HttpClient) -> Option<String> {
    let models = client.get_json("/v1/models").await.ok()?;
    models["data"][0]["id"].as_str().map(str::to_owned)
}
