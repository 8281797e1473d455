//! `POST /v1/chat/completions`.

mod response;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;

use super::body::{CacheScope, RawJson};
use super::choices::Choices;
use super::{json_response, random_id, sse, unix_now, with_route, ApiError};
use crate::generation::Generation;
use crate::prepare;
use crate::protocol::chat::ChatRequest;
use crate::protocol::options::check_choices;
use crate::state::SharedState;

/// Chat completion, streamed as server-sent events when `stream` is true.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    request_body = crate::protocol::chat::ChatBody,
    responses(
        (status = 200, description = "The completion (JSON), or `text/event-stream` chunks", body = crate::protocol::Completion),
        crate::protocol::error::GenerationErrors,
    ),
    security((), ("api_key" = []))
)]
pub async fn create(
    State(state): State<SharedState>,
    scope: Option<Extension<CacheScope>>,
    RawJson(body): RawJson,
) -> Result<Response, ApiError> {
    let mut request = ChatRequest::parse(&body, state.model.vocab)?;
    state.model.fill_sampling(&mut request.options);
    let max_param = if body.get("max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let n = request.options.n;
    check_choices(n, 1, state.config.server.max_n)?;
    let prepared =
        prepare::chat(&state, &request, max_param, scope.map(|Extension(s)| s.0)).await?;
    let model = prepared.model.clone();
    let loaded = &state.registry.shared.model;
    let id = random_id("chatcmpl-");
    let created = unix_now();
    let tokenizer = (*loaded.tokenizer).clone();
    let chunks = response::ChatChunks {
        id: id.clone(),
        created,
        model: model.clone(),
        include_usage: request.options.include_usage,
        tokenizer: tokenizer.clone(),
        tool_calls: 0,
    };
    if n > 1 {
        let choices = Choices::start(&state, vec![prepared], n).await?;
        let formats = vec![chunks; n as usize];
        let whole = |_: usize, batch: &_, summary: &_| {
            response::completion(&id, created, &model, &tokenizer, batch, summary)
        };
        return Ok(choices
            .respond(request.options.stream, formats, whole)
            .await);
    }
    let generation = Generation::start(&state, prepared)?;
    let (engine, rule) = (generation.engine.clone(), generation.rule.clone());
    let response = if request.options.stream {
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
