//! `gateway policy explain` and `gateway policy test`: a routing policy
//! tried before it ships. Both read the config's `engines:` and `policy:`,
//! build the engines as the server does (the model loads) for their
//! declared capabilities, and route with the policies crate's own
//! evaluation among the engines that accept the request, as the router
//! does; nothing is served. A request's needs are read from its signals
//! (`greedy`, `has_tools`, `has_images`; an exclusive engine takes it only
//! while `total_active` and `total_queued` are 0), and in `explain` also
//! from the body (`response_format`'s grammar, `logprobs`).
//!
//! Signals of live load (`total_active`, `total_queued`, `kv_pressure`,
//! `engine_active.NAME`, `engine_queued.NAME`, `engine_accept_rate.NAME`,
//! `engine_speedup.NAME`) come from the file or default to an idle server.

use std::path::Path;

use anyhow::{bail, Context};
use engine_core::Needs;
use policies::{parse_cases, Policy, Signals};
use serde_json::{json, Map, Value};

use crate::config::{Config, Overrides};
use crate::host::{self, Registry};
use crate::prepare;
use crate::protocol::chat::ChatRequest;
use crate::protocol::completions::{CompletionRequest, Prompt};
use crate::protocol::options::{resolve_max_tokens, GenOptions, Limits};
use crate::protocol::responses::ResponsesRequest;

/// The config's policy, validated against its engines.
fn load(config: &Path) -> anyhow::Result<(Config, Policy)> {
    let parsed = Config::load(config, &Overrides::default())?;
    let names: Vec<&str> = parsed.engines.iter().map(|e| e.name.as_str()).collect();
    let text =
        std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let policy = Policy::from_config_yaml(&text, &names)
        .with_context(|| format!("the policy in {}", config.display()))?;
    Ok((parsed, policy))
}

/// The model and the config's engines, built as the server builds them
/// (seconds: each plugin opens), for their declared capabilities. Called
/// once the inputs have been read, so a bad file fails at once.
fn build_engines(config: &Config) -> anyhow::Result<Registry> {
    // Nothing is served: a small KV pool, not the server's, so the tools
    // also run beside a server that holds the memory.
    let mut config = config.clone();
    config.memory = None;
    config.model.kv_cache_mb = Some(64);
    config.model.kv_layout = runtime::paged::KvLayout::Contiguous;
    let registry = Registry::load(&config).context("building the config's engines")?;
    for failed in &registry.failed {
        eprintln!(
            "warning: engine `{}` did not load ({}); the server would route around it",
            failed.name, failed.error
        );
    }
    Ok(registry)
}

/// What a request with `signals` needs of an engine; in flight beside it,
/// what runs or waits anywhere.
fn needs(signals: &Signals, grammar: bool, logprobs: bool) -> Needs {
    Needs {
        plain_greedy: signals.greedy,
        tools: signals.has_tools,
        images: signals.has_images,
        grammar,
        logprobs,
        in_flight: (signals.total_active + signals.total_queued) as usize,
    }
}

/// Prints the signals of the request in `request` (an API request body,
/// chat, completions or responses, with an optional `signals` object whose
/// values win), each rule's verdict, and the engine chosen.
pub fn explain(config: &Path, request: &Path) -> anyhow::Result<()> {
    let (config, policy) = load(config)?;
    let text = std::fs::read_to_string(request)
        .with_context(|| format!("reading {}", request.display()))?;
    let mut body: Map<String, Value> = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a JSON object", request.display()))?;
    let given = match body.remove("signals") {
        None => Map::new(),
        Some(Value::Object(given)) => given,
        Some(_) => bail!("`signals` in {} must be an object", request.display()),
    };
    let registry = build_engines(&config)?;
    let (kind, mut signals, options) = request_signals(
        &config,
        &registry.shared.model,
        &Value::Object(body),
        &given,
    )?;
    signals.extend(given);
    let signals: Signals = serde_json::from_value(Value::Object(signals))
        .with_context(|| format!("the signals of {}", request.display()))?;

    println!("request: {kind}");
    println!("signals:");
    for (name, value) in signals.named() {
        println!("  {name}: {value}");
    }
    let needs = needs(
        &signals,
        options.structured.is_some(),
        options.sampling.logprobs,
    );
    let engines = registry.engines();
    let takes = |name: &str| host::takes(engines, name, &needs);
    let decision = policy.decide_where(&signals, takes);
    println!(
        "rules (the first that holds, routing to an engine that accepts the request, decides):"
    );
    let width = policy.routes().map(|(r, _)| r.len()).max().unwrap_or(0);
    for v in policy.verdicts(&signals) {
        let verdict = if v.holds { "holds" } else { "-" };
        let mark = if v.rule == decision.rule {
            "  <- decides".to_owned()
        } else if v.holds {
            format!("  <- passed over: {}", refusal(&registry, v.route, &needs))
        } else {
            String::new()
        };
        println!("  {:width$}  {verdict:5}  route {}{mark}", v.rule, v.route);
    }
    let Some(engine) = decision.first_where(takes) else {
        let why: Vec<String> = decision
            .chain()
            .iter()
            .map(|e| refusal(&registry, e, &needs))
            .collect();
        println!(
            "engine: none (rule `{}`: {})",
            decision.rule,
            why.join("; ")
        );
        return Ok(());
    };
    let then: Vec<&str> = decision
        .chain()
        .iter()
        .map(String::as_str)
        .filter(|&e| e != engine && takes(e))
        .collect();
    let fallback = match then.as_slice() {
        [] => String::new(),
        f => format!(", then {}", f.join(", ")),
    };
    println!("engine: {engine} (rule `{}`{fallback})", decision.rule);
    Ok(())
}

/// Why `engine` cannot take a request with `needs`, by its capabilities.
fn refusal(registry: &Registry, engine: &str, needs: &Needs) -> String {
    match registry.get(engine).map(|e| e.capabilities.accepts(needs)) {
        None => format!("{engine}: not loaded"),
        Some(Err(why)) => format!("{engine}: {why}"),
        Some(Ok(())) => format!("{engine}: accepts it"),
    }
}

/// The request's own signals, as the gateway reads them, and its options:
/// `model`,
/// `greedy`, `has_tools`, `has_images`, `max_tokens`, and `prompt_tokens`
/// counted with the model's tokenizer and chat template (unless `given`
/// has `prompt_tokens`; then the checkpoint's sampling defaults are not
/// read and `greedy` is the body's own).
fn request_signals(
    config: &Config,
    loaded: &runtime::LoadedModel,
    body: &Value,
    given: &Map<String, Value>,
) -> anyhow::Result<(&'static str, Map<String, Value>, GenOptions)> {
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
            let defaults = config
                .model
                .generation_config
                .defaults(loaded.sampling_defaults);
            options.fill_sampling(&defaults);
            let prompt = match &chat {
                Some(chat) => {
                    let text = prepare::chat_text(
                        loaded,
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
    Ok((kind, signals, options))
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
    let (config, policy) = load(config)?;
    let names: Vec<&str> = config.engines.iter().map(|e| e.name.as_str()).collect();
    let text =
        std::fs::read_to_string(cases).with_context(|| format!("reading {}", cases.display()))?;
    let cases_read = parse_cases(&text, &names).with_context(|| format!("{}", cases.display()))?;
    let registry = build_engines(&config)?;
    let mut failed = 0;
    for case in &cases_read {
        let needs = needs(&case.signals, false, false);
        let got = case.check(&policy, |name| {
            host::takes(registry.engines(), name, &needs)
        });
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
