//! The prepare stage: the one place an API request becomes what generation
//! needs, the validated [`GenerateRequest`] (prompt ids, limits, sampling,
//! stop tokens, tools, images, cache scope) and the text pipeline's
//! [`PipelineOptions`]. Chat template rendering and tokenization run on
//! tokio's blocking pool: a long prompt must not stall the other
//! connections on the async executor. How the output is parsed (reasoning,
//! tool calls) comes from the loaded model's family.

use std::sync::Arc;

use engine_core::{GenerateRequest, Grammar};
use grammar::CallRule;
use serde_json::Value;
use text::reasoning::ReasoningFormat;
use text::template::TemplateError;
use text::tools::{ToolFormat, ToolParser, ToolSchemas};
use text::RenderOptions;

use crate::pipeline::PipelineOptions;
use crate::protocol::chat::{CallSchema, ChatRequest, ToolChoice};
use crate::protocol::completions::{CompletionRequest, Prompt};
use crate::protocol::options::{resolve_max_tokens, GenOptions};
use crate::protocol::structured::StructuredOutput;
use crate::protocol::ApiError;
use crate::state::{AppState, SharedState};

/// A request ready to route.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The served model's name, as the request gave it.
    pub model: String,
    pub request: GenerateRequest,
    pub text: PipelineOptions,
    /// The grammar is a best effort (tool calls under `tool_choice:
    /// "auto"`): an engine that applies no grammars serves the request
    /// unconstrained rather than refusing it.
    pub grammar_optional: bool,
}

impl Prepared {
    /// Choice `i` of a request asking for several: its own id and cancel
    /// flag, and with a seed, its own seed (else all would be alike).
    pub fn choice(&self, i: u32) -> Prepared {
        let mut choice = self.clone();
        let req = &mut choice.request;
        req.id = engine_core::RequestId::next();
        req.cancel = engine_core::CancelToken::new();
        req.sampling.seed = req.sampling.seed.map(|s| s.wrapping_add(u64::from(i)));
        choice
    }
}

/// `/v1/chat/completions`: renders the chat template, places the images,
/// tokenizes, and encodes the images once the rest is known to be valid.
/// `max_param` names the field the client set its limit with.
pub async fn chat(
    state: &SharedState,
    request: &ChatRequest,
    max_param: &'static str,
    scope: Option<String>,
) -> Result<Prepared, ApiError> {
    let model = state.check_model(request.model.as_deref())?;
    if let (None, Some(first)) = (&state.vision, request.images.first()) {
        return Err(ApiError::InvalidRequest {
            message: format!("the model `{model}` does not read images"),
            param: Some(first.param.clone()),
            code: Some("images_not_supported"),
        });
    }
    let options = render_options(request);
    let has_tools = options.tools.as_ref().is_some_and(|t| !t.is_empty());
    let messages = request.template_messages();
    let images = request.images.len();
    let vision = state.vision.as_ref().filter(|_| images > 0);
    // Each image's soft-token count goes into the prompt. Where it depends
    // on the image (Gemma 4), the images are read (not decoded) first;
    // else the prompt is checked before any image is read.
    let mut fetched = None;
    let counts = match vision {
        None => Vec::new(),
        Some(v) => match v.fixed_tokens() {
            Some(n) => vec![n; images],
            None => {
                let f = v.fetch(&request.images).await?;
                let counts = f.iter().map(|f| f.tokens).collect();
                fetched = Some(f);
                counts
            }
        },
    };
    let rendered = blocking(state, move |state| {
        render_chat(state, &messages, &options, &counts)
    })
    .await?;
    let max_tokens = resolve_max_tokens(
        rendered.prompt.len(),
        request.options.max_tokens,
        &state.limits(),
        "messages",
        max_param,
    )?;
    let family = state.registry.shared.model.model.config.family;
    let source = match &request.options.structured {
        Some(given) => Some(GrammarSource::Given(given.clone())),
        None if has_tools => Some(GrammarSource::ToolCalls {
            format: family.tool_format(),
            tools: request.call_schemas(),
            rule: CallRule {
                forced: matches!(
                    request.tool_choice,
                    ToolChoice::Required | ToolChoice::Named(_)
                ),
                parallel: request.parallel_tool_calls
                    && !matches!(request.tool_choice, ToolChoice::Named(_)),
            },
        }),
        None => None,
    };
    let grammar_optional = matches!(
        &source,
        Some(GrammarSource::ToolCalls { rule, .. }) if !rule.forced
    );
    let reasoning = family.reasoning_format();
    let starts_in_reasoning = ends_in_reasoning(&rendered.text, reasoning);
    let thinks = starts_in_reasoning
        || request.template_kwargs.get("enable_thinking") == Some(&Value::Bool(true));
    let tags = reasoning.tags();
    let exempt = match (tags.open.first(), tags.close.first()) {
        (Some(open), Some(close)) if thinks => Some(ReasoningExempt {
            open: (!starts_in_reasoning).then(|| open.to_string()),
            close: close.to_string(),
        }),
        _ => None,
    };
    let mut req = engine_request(state, rendered.prompt, max_tokens, &request.options);
    req.grammar = grammar(state, source, exempt).await?;
    req.has_tools = has_tools;
    req.cache_scope = scope;
    // Images are decoded and encoded only for a request that is otherwise
    // valid: the tower is the expensive part.
    if let Some(vision) = vision {
        let fetched = match fetched {
            Some(f) => f,
            None => vision.fetch(&request.images).await?,
        };
        let prepared = vision.encode(&request.images, fetched).await?;
        req.images = vision.inputs(&prepared, &rendered.image_starts);
        // Image placeholders are the same ids for every image: prefix
        // cache entries are shared only between requests with the same
        // images.
        let images = image_scope(&prepared);
        req.cache_scope = Some(match req.cache_scope {
            Some(s) => format!("{s}|{images}"),
            None => images,
        });
    }
    let text = PipelineOptions {
        stop: request.options.stop.clone(),
        reasoning,
        starts_in_reasoning,
        tools: has_tools.then(|| {
            let offered = request.offered_tools().unwrap_or_default();
            let schemas = ToolSchemas::from_tools(&offered);
            ToolParser::with_schemas(family.tool_format(), Arc::new(schemas))
        }),
        thinking_budget: request.options.thinking_budget,
    };
    Ok(Prepared {
        model,
        request: req,
        text,
        grammar_optional,
    })
}

/// `/v1/completions`: tokenizes one text prompt (or decodes a token prompt,
/// for `echo`). Returns the prompt's text too.
pub async fn completion(
    state: &SharedState,
    request: &CompletionRequest,
    prompt: &Prompt,
    scope: Option<String>,
) -> Result<(Prepared, String), ApiError> {
    let model = state.check_model(request.model.as_deref())?;
    let prompt = prompt.clone();
    let (ids, text) = blocking(state, move |state| {
        let tokenizer = &state.registry.shared.model.tokenizer;
        Ok(match prompt {
            Prompt::Text(t) => {
                let ids = tokenizer
                    .encode_completion(&t)
                    .map_err(|e| ApiError::Internal(e.to_string()))?;
                (ids, t)
            }
            Prompt::Tokens(ids) => {
                let text = tokenizer.decode(&ids, false).unwrap_or_default();
                (ids, text)
            }
        })
    })
    .await?;
    let max_tokens = resolve_max_tokens(
        ids.len(),
        request.options.max_tokens,
        &state.limits(),
        "prompt",
        "max_tokens",
    )?;
    let mut req = engine_request(state, ids, max_tokens, &request.options);
    let source = request.options.structured.clone().map(GrammarSource::Given);
    req.grammar = grammar(state, source, None).await?;
    req.cache_scope = scope;
    let prepared = Prepared {
        model,
        request: req,
        text: PipelineOptions::plain(request.options.stop.clone()),
        grammar_optional: false,
    };
    Ok((prepared, text))
}

/// The rendered chat prompt: its text, its ids, where its images start.
struct Rendered {
    text: String,
    prompt: Vec<u32>,
    image_starts: Vec<usize>,
}

fn render_chat(
    state: &AppState,
    messages: &[Value],
    options: &RenderOptions,
    image_tokens: &[usize],
) -> Result<Rendered, ApiError> {
    let loaded = &state.registry.shared.model;
    let text = chat_text(loaded, messages, options)?;
    let vision = state.vision.as_ref().filter(|_| !image_tokens.is_empty());
    let expanded = match vision {
        Some(vision) => vision
            .tokens
            .expand(&text, image_tokens)
            .map_err(|e| e.into_api("messages"))?,
        None => text.clone(),
    };
    let prompt = loaded
        .tokenizer
        .encode_chat(&expanded)
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    let image_starts = match vision {
        Some(vision) => vision
            .tokens
            .spans(&prompt, image_tokens)
            .map_err(|e| e.into_api("messages"))?,
        None => Vec::new(),
    };
    Ok(Rendered {
        text,
        prompt,
        image_starts,
    })
}

/// The chat template rendered over `messages`: the prompt's text.
pub fn chat_text(
    loaded: &runtime::LoadedModel,
    messages: &[Value],
    options: &RenderOptions,
) -> Result<String, ApiError> {
    let template = loaded.template.as_ref().ok_or_else(|| {
        ApiError::invalid_no_param(
            "This model has no chat template; use /v1/completions with a plain prompt",
        )
    })?;
    template.render(messages, options).map_err(|e| match e {
        TemplateError::Raised(message) => ApiError::invalid(message, "messages"),
        TemplateError::Render(message) => ApiError::invalid(
            format!("The chat template cannot render these messages: {message}"),
            "messages",
        ),
        other => ApiError::Internal(other.to_string()),
    })
}

/// The template options a chat request renders with: the offered tools
/// and the template kwargs, with the generation prompt.
pub fn render_options(request: &ChatRequest) -> RenderOptions {
    RenderOptions {
        tools: request.offered_tools(),
        add_generation_prompt: true,
        kwargs: request.template_kwargs.clone(),
    }
}

/// What both endpoints set the same way: the prompt, the limit, the
/// sampling parameters, and the model's stop tokens unless `ignore_eos`.
fn engine_request(
    state: &AppState,
    prompt: Vec<u32>,
    max_tokens: u32,
    options: &GenOptions,
) -> GenerateRequest {
    let mut req = GenerateRequest::new(prompt, max_tokens);
    req.sampling = options.sampling.clone();
    if !options.ignore_eos {
        req.stop_tokens = state.registry.shared.model.stop_tokens.clone();
    }
    req
}

/// Where a request's grammar comes from.
pub enum GrammarSource {
    /// Structured outputs the client gave.
    Given(StructuredOutput),
    /// Tool calls, held to the offered tools' parameters.
    ToolCalls {
        format: ToolFormat,
        tools: Vec<CallSchema>,
        rule: CallRule,
    },
}

/// A request that thinks writes its reasoning free of the grammar, as
/// vLLM's reasoning parsers do: the grammar applies after the block's
/// `close` tag (and the block may be skipped, when `open` is given: the
/// prompt has not opened it).
pub struct ReasoningExempt {
    open: Option<String>,
    close: String,
}

/// The request's grammar, compiled here once against the model's tokenizer
/// (on the blocking pool; engines reuse nothing of it but the check): a
/// schema or grammar llguidance cannot use is the client's 400, naming the
/// field it came from.
pub async fn grammar(
    state: &SharedState,
    source: Option<GrammarSource>,
    exempt: Option<ReasoningExempt>,
) -> Result<Option<Grammar>, ApiError> {
    let Some(source) = source else {
        return Ok(None);
    };
    blocking(state, move |state| {
        let compiler = state.registry.shared.grammars().map_err(|e| {
            ApiError::invalid(
                format!("structured outputs are not available for this model: {e}"),
                "response_format",
            )
        })?;
        let (grammar, param) = match source {
            GrammarSource::Given(s) => (s.grammar, s.param),
            GrammarSource::ToolCalls { format, tools, rule } => {
                for tool in &tools {
                    compiler.check_schema(&tool.parameters).map_err(|e| {
                        let at = match e.pointer.as_str() {
                            "" => String::new(),
                            pointer => format!(" at {pointer}"),
                        };
                        ApiError::invalid(
                            format!(
                                "tool `{}`: its parameters schema{at} cannot be used for constrained decoding: {}",
                                tool.name, e.message
                            ),
                            format!("tools[{}].function.parameters", tool.index),
                        )
                    })?;
                }
                let tools: Vec<(String, Value)> = tools
                    .into_iter()
                    .map(|t| (t.name, t.parameters))
                    .collect();
                (compiler.tool_calls(format, &tools, rule), "tools".to_owned())
            }
        };
        let grammar = match exempt {
            Some(ReasoningExempt { open, close }) => Grammar::AfterReasoning {
                open,
                close,
                then: Box::new(grammar),
            },
            None => grammar,
        };
        compiler.compile(&grammar).map_err(|e| {
            ApiError::invalid(
                format!("`{param}` cannot be used for constrained decoding: {e}"),
                param,
            )
        })?;
        Ok(Some(grammar))
    })
    .await
}

/// Runs CPU-bound preparation (template, tokenizer) on the blocking pool.
async fn blocking<T: Send + 'static>(
    state: &SharedState,
    work: impl FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let state = state.clone();
    tokio::task::spawn_blocking(move || work(&state))
        .await
        .map_err(|e| ApiError::Internal(format!("preparing the request failed: {e}")))?
}

/// The prefix-cache scope of a request's images: their content hashes.
fn image_scope(images: &[crate::vision::PreparedImage]) -> String {
    let hashes: Vec<String> = images
        .iter()
        .map(|i| crate::vision::cache::hex(&i.hash))
        .collect();
    format!("images:{}", hashes.join(","))
}

/// Whether the rendered prompt ends inside an open reasoning block (e.g. a
/// template that appends `<think>\n`): then generation starts in reasoning.
pub fn ends_in_reasoning(prompt: &str, format: ReasoningFormat) -> bool {
    let tags = format.tags();
    let last = |tags: &[&str]| tags.iter().filter_map(|t| prompt.rfind(t)).max();
    match (last(tags.open), last(tags.close)) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_open_at_the_end_of_the_prompt() {
        let think = ReasoningFormat::Think;
        assert!(ends_in_reasoning("<|im_start|>assistant\n<think>\n", think));
        assert!(!ends_in_reasoning(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n",
            think
        ));
        assert!(!ends_in_reasoning("<|im_start|>assistant\n", think));
        assert!(!ends_in_reasoning(
            "<think>x</think> a <think>y</think>",
            think
        ));
        assert!(!ends_in_reasoning("<think>", ReasoningFormat::None));
        assert!(ends_in_reasoning(
            "<start_of_turn>model\n<|channel>thought\n",
            ReasoningFormat::GemmaChannel
        ));
    }
}
