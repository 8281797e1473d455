//! `gateway policy explain` and `gateway policy test`: a routing policy
//! tried before it ships. Both read the config's `engines:` and `policy:`
//! and route with the policies crate's own evaluation; nothing is served.
//!
//! Signals of live load (`total_active`, `total_queued`, `kv_pressure`,
//! `engine_active.NAME`, `engine_queued.NAME`, `engine_accept_rate.NAME`,
//! `engine_speedup.NAME`) come from the file or default to an idle server.

use std::path::Path;

use anyhow::{bail, Context};
use policies::{parse_cases, Policy, Signals};
use serde_json::{json, Map, Value};

use crate::config::{Config, Overrides};
use crate::prepare;
use crate::protocol::chat::ChatRequest;
use crate::protocol::completions::{CompletionRequest, Prompt};
use crate::protocol::options::{resolve_max_tokens, GenOptions, Limits};
use crate::protocol::responses::ResponsesRequest;

/// The config's policy, validated against its engines.
fn load(config: &Path) -> anyhow::Result<(Config, Policy, Vec<String>)> {
    let parsed = Config::load(config, &Overrides::default())?;
    let engines: Vec<String> = parsed.engines.iter().map(|e| e.name.clone()).collect();
    let names: Vec<&str> = engines.iter().map(String::as_str).collect();
    let text =
        std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let policy = Policy::from_config_yaml(&text, &names)
        .with_context(|| format!("the policy in {}", config.display()))?;
    Ok((parsed, policy, engines))
}

/// Prints the signals of the request in `request` (an API request body,
/// chat, completions or responses, with an optional `signals` object whose
/// values win), each rule's verdict, and the engine chosen.
pub fn explain(config: &Path, request: &Path) -> anyhow::Result<()> {
    let (config, policy, _) = load(config)?;
    let text = std::fs::read_to_string(request)
        .with_context(|| format!("reading {}", request.display()))?;
    let mut body: Map<String, Value> = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a JSON object", request.display()))?;
    let given = match body.remove("signals") {
        None => Map::new(),
        Some(Value::Object(given)) => given,
        Some(_) => bail!("`signals` in {} must be an object", request.display()),
    };
    let (kind, mut signals) = request_signals(&config, &Value::Object(body), &given)?;
    signals.extend(given);
    let signals: Signals = serde_json::from_value(Value::Object(signals))
        .with_context(|| format!("the signals of {}", request.display()))?;

    println!("request: {kind}");
    println!("signals:");
    for (name, value) in signals.named() {
        println!("  {name}: {value}");
    }
    let decision = policy.decide(&signals);
    println!("rules (the first that holds decides):");
    let width = policy.routes().map(|(r, _)| r.len()).max().unwrap_or(0);
    for v in policy.verdicts(&signals) {
        let verdict = if v.holds { "holds" } else { "-" };
        let mark = if v.rule == decision.rule {
            "  <- decides"
        } else {
            ""
        };
        println!("  {:width$}  {verdict:5}  route {}{mark}", v.rule, v.route);
    }
    let fallback = match decision.fallback {
        [] => String::new(),
        f => format!(", then {}", f.join(", ")),
    };
    println!(
        "engine: {} (rule `{}`{fallback})",
        decision.engine, decision.rule
    );
    Ok(())
}

/// The request's own signals, as the gateway reads them: `model`,
/// `greedy`, `has_tools`, `has_images`, `max_tokens`, and `prompt_tokens`
/// counted with the model's tokenizer and chat template (loaded only when
/// `given` has no `prompt_tokens`; with it, the checkpoint's sampling
/// defaults are not read and `greedy` is the body's own).
fn request_signals(
    config: &Config,
    body: &Value,
    given: &Map<String, Value>,
) -> anyhow::Result<(&'static str, Map<String, Value>)> {
    let vocab = u32::MAX as usize;
    let refused = |e: crate::protocol::ApiError| {
        anyhow::anyhow!("the gateway would refuse this request: {e}")
    };
    let (kind, model, mut options, chat) = if body.get("messages").is_some() {
        let chat = ChatRequest::parse(body, vocab).map_err(refused)?;
        (
            "chat completion",
            chat.model.clone(),
            chat.options.clone(),
            Some(chat),
        )
    } else if body.get("input").is_some() {
        let chat = ResponsesRequest::parse(body, vocab).map_err(refused)?.chat;
        (
            "response",
            chat.model.clone(),
            chat.options.clone(),
            Some(chat),
        )
    } else if body.get("prompt").is_some() {
        let c = CompletionRequest::parse(body, vocab).map_err(refused)?;
        if c.prompts.len() > 1 {
            bail!("explain one prompt at a time ({} given)", c.prompts.len());
        }
        ("completion", c.model.clone(), c.options.clone(), None)
    } else {
        bail!("not a request body: no `messages`, `input` or `prompt`");
    };
    let Some(model) = model else {
        bail!("the gateway would refuse this request: `model` is required");
    };
    let has_tools = chat
        .as_ref()
        .and_then(ChatRequest::offered_tools)
        .is_some_and(|t| !t.is_empty());
    let has_images = chat.as_ref().is_some_and(|c| !c.images.is_empty());
    let mut signals = Map::new();
    signals.insert("model".into(), json!(model));
    signals.insert("has_tools".into(), json!(has_tools));
    signals.insert("has_images".into(), json!(has_images));
    let max_tokens = match given.get("prompt_tokens") {
        // The window is the model's: without it, the config's default.
        Some(_) => options
            .max_tokens
            .unwrap_or(config.model.default_max_tokens),
        None => {
            if has_images {
                bail!("give `signals.prompt_tokens` for a request with images: their tokens are counted by the vision tower at serving time");
            }
            let loaded = runtime::LoadedModel::load_as(
                &config.model.path,
                config.model.name.as_deref(),
                config.model.compute_dtype,
            )
            .context(
                "loading the model to count the prompt's tokens (or give `signals.prompt_tokens`)",
            )?;
            let defaults = config
                .model
                .generation_config
                .defaults(loaded.sampling_defaults);
            options.fill_sampling(&defaults);
            let prompt = match &chat {
                Some(chat) => {
                    let text = prepare::chat_text(
                        &loaded,
                        &chat.template_messages(),
                        &prepare::render_options(chat),
                    )
                    .map_err(refused)?;
                    loaded.tokenizer.encode_chat(&text)?.len()
                }
                None => match CompletionRequest::parse(body, vocab)
                    .map_err(refused)?
                    .prompts[0]
                {
                    Prompt::Text(ref t) => loaded.tokenizer.encode_completion(t)?.len(),
                    Prompt::Tokens(ref ids) => ids.len(),
                },
            };
            signals.insert("prompt_tokens".into(), json!(prompt));
            // The KV pool's bound is not applied: it is sized at startup.
            let limits = Limits {
                context_window: loaded.context_window(),
                default_max_tokens: config.model.default_max_tokens,
                pool_tokens: usize::MAX,
            };
            resolve_max_tokens(prompt, options.max_tokens, &limits, "prompt", "max_tokens")
                .map_err(refused)?
        }
    };
    signals.insert("max_tokens".into(), json!(max_tokens));
    signals.insert("greedy".into(), json!(greedy(&options)));
    Ok((kind, signals))
}

/// Plain greedy decoding, by the engines' own definition.
fn greedy(options: &GenOptions) -> bool {
    let mut req = engine_core::GenerateRequest::new(Vec::new(), 1);
    req.sampling = options.sampling.clone();
    req.is_plain_greedy()
}

/// Checks every case in `cases` against the policy, printing each; false
/// when any routes elsewhere than it expects.
pub fn test(config: &Path, cases: &Path) -> anyhow::Result<bool> {
    let (_, policy, engines) = load(config)?;
    let names: Vec<&str> = engines.iter().map(String::as_str).collect();
    let text =
        std::fs::read_to_string(cases).with_context(|| format!("reading {}", cases.display()))?;
    let cases_read = parse_cases(&text, &names).with_context(|| format!("{}", cases.display()))?;
    let mut failed = 0;
    for case in &cases_read {
        let got = case.check(&policy);
        if got.pass {
            println!("ok    {}: {} (rule `{}`)", case.name, got.engine, got.rule);
        } else {
            failed += 1;
            let expected = match &case.rule {
                Some(rule) => format!("{} (rule `{rule}`)", case.engine),
                None => case.engine.clone(),
            };
            println!(
                "FAIL  {}: routed to {} (rule `{}`), expected {expected}",
                case.name, got.engine, got.rule
            );
        }
    }
    println!("{} cases, {failed} failed", cases_read.len());
    Ok(failed == 0)
}
