//! `POST /v1/chat/completions`.

mod request;
mod response;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use runtime::Family;
use text::reasoning::ReasoningFormat;
use text::template::TemplateError;
use text::tools::ToolFormat;
use text::RenderOptions;

pub use request::ChatRequest;

use super::body::{CacheScope, RawJson};
use super::validate::resolve_max_tokens;
use super::{json_response, random_id, sse, unix_now, with_route, ApiError};
use crate::generation::{Generation, Plan};
use crate::pipeline::PipelineOptions;
use crate::state::SharedState;

/// How the model family marks reasoning and tool calls in its output.
pub fn reasoning_format(family: Family) -> ReasoningFormat {
    match family {
        Family::Qwen3 => ReasoningFormat::Think,
        Family::Gemma3 | Family::Gemma4 => ReasoningFormat::GemmaChannel,
        Family::Llama | Family::Qwen2 => ReasoningFormat::None,
    }
}

pub fn tool_format(family: Family) -> ToolFormat {
    match family {
        Family::Qwen2 | Family::Qwen3 => ToolFormat::Hermes,
        Family::Llama => ToolFormat::Llama3Json,
        Family::Gemma3 | Family::Gemma4 => ToolFormat::Gemma,
    }
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

/// Chat completion, streamed as server-sent events when `stream` is true.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    request_body = crate::api::openapi::ChatCompletionRequest,
    responses(
        (status = 200, description = "The completion (JSON), or `text/event-stream` chunks", body = crate::api::openapi::Completion),
        crate::api::openapi::GenerationErrors,
    ),
    security((), ("api_key" = []))
)]
pub async fn create(
    State(state): State<SharedState>,
    scope: Option<Extension<CacheScope>>,
    RawJson(body): RawJson,
) -> Result<Response, ApiError> {
    let request = ChatRequest::parse(&body, state.model.vocab)?;
    let model = state.check_model(request.model.as_deref())?;
    let vision = match (&state.vision, request.images.first()) {
        (_, None) => None,
        (Some(vision), Some(_)) => Some(vision),
        (None, Some(first)) => {
            return Err(ApiError::InvalidRequest {
                message: format!("the model `{model}` does not read images"),
                param: Some(first.param.clone()),
                code: Some("images_not_supported"),
            })
        }
    };
    let loaded = &state.registry.shared.model;
    let template = loaded.template.as_ref().ok_or_else(|| {
        ApiError::invalid_no_param(
            "This model has no chat template; use /v1/completions with a plain prompt",
        )
    })?;
    let tools = request.offered_tools();
    let options = RenderOptions {
        tools: tools.clone(),
        add_generation_prompt: true,
        kwargs: request.template_kwargs.clone(),
    };
    let rendered = template
        .render(&request.template_messages(), &options)
        .map_err(|e| match e {
            TemplateError::Raised(message) => ApiError::invalid(message, "messages"),
            TemplateError::Render(message) => ApiError::invalid(
                format!("The chat template cannot render these messages: {message}"),
                "messages",
            ),
            other => ApiError::Internal(other.to_string()),
        })?;
    let count = request.images.len();
    let expanded = match vision {
        Some(vision) => vision
            .tokens
            .expand(&rendered, count)
            .map_err(|e| e.into_api("messages"))?,
        None => rendered.clone(),
    };
    let prompt = loaded
        .tokenizer
        .encode_chat(&expanded)
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    let image_starts = match vision {
        Some(vision) => vision
            .tokens
            .spans(&prompt, count)
            .map_err(|e| e.into_api("messages"))?,
        None => Vec::new(),
    };
    let max_param = if body.get("max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = resolve_max_tokens(
        prompt.len(),
        request.options.max_tokens,
        &state.limits(),
        "messages",
        max_param,
    )?;
    // Images are fetched and encoded only for a request that is otherwise
    // valid: the tower is the expensive part.
    let (image_inputs, image_scope) = match vision {
        Some(vision) => {
            let prepared = vision.prepare(&request.images).await?;
            (
                vision.inputs(&prepared, &image_starts),
                Some(image_scope(&prepared)),
            )
        }
        None => (Vec::new(), None),
    };
    let reasoning = reasoning_format(state.model.family);
    let has_tools = tools.as_ref().is_some_and(|t| !t.is_empty());
    let plan = Plan {
        model: model.clone(),
        prompt,
        max_tokens,
        sampling: request.options.sampling.clone(),
        text: PipelineOptions {
            stop: request.options.stop.clone(),
            reasoning,
            starts_in_reasoning: ends_in_reasoning(&rendered, reasoning),
            tools: has_tools.then(|| tool_format(state.model.family)),
        },
        has_tools,
        // Image placeholders are the same ids for every image: prefix
        // cache entries are shared only between requests with the same
        // images.
        cache_scope: match (scope.map(|Extension(s)| s.0), image_scope) {
            (Some(s), Some(i)) => Some(format!("{s}|{i}")),
            (s, i) => s.or(i),
        },
        ignore_eos: request.options.ignore_eos,
        images: image_inputs,
    };
    let generation = Generation::start(&state, plan)?;
    let (engine, rule) = (generation.engine.clone(), generation.rule.clone());
    let id = random_id("chatcmpl-");
    let created = unix_now();
    let tokenizer = (*loaded.tokenizer).clone();
    let response = if request.options.stream {
        let chunks = response::ChatChunks {
            id,
            created,
            model,
            include_usage: request.options.include_usage,
            tokenizer,
            tool_calls: 0,
        };
        sse::response(generation, chunks)
    } else {
        // Errors after routing still say which engine and rule they met.
        match generation.collect().await {
            Ok((batch, summary)) => json_response(
                StatusCode::OK,
                &response::completion(&id, created, &model, &tokenizer, &batch, &summary),
            ),
            Err(e) => e.into_response(),
        }
    };
    Ok(with_route(response, &engine, &rule))
}

/// The prefix-cache scope of a request's images: their content hashes.
fn image_scope(images: &[crate::vision::PreparedImage]) -> String {
    let hashes: Vec<String> = images
        .iter()
        .map(|i| crate::vision::cache::hex(&i.hash))
        .collect();
    format!("images:{}", hashes.join(","))
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

    #[test]
    fn formats_by_family() {
        assert_eq!(tool_format(Family::Qwen3), ToolFormat::Hermes);
        assert_eq!(tool_format(Family::Llama), ToolFormat::Llama3Json);
        assert_eq!(tool_format(Family::Gemma3), ToolFormat::Gemma);
        assert_eq!(reasoning_format(Family::Qwen3), ReasoningFormat::Think);
        assert_eq!(
            reasoning_format(Family::Gemma3),
            ReasoningFormat::GemmaChannel
        );
        assert_eq!(reasoning_format(Family::Llama), ReasoningFormat::None);
    }
}
