//! The completions request: a raw prompt (text or token ids), or a list
//! of them, and the generation options.

use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::body::{as_int, whole, wrong_type};
use super::chat::ModelName;
use super::options::{gen_options, GenOptions, GenerationOptions};
use super::ApiError;

/// A prompt as text or as token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = CompletionRequest)]
pub struct CompletionBody {
    #[schema(value_type = ModelName, required = true)]
    pub model: Option<ModelName>,
    #[schema(value_type = PromptInput, required = true)]
    pub prompt: Option<PromptInput>,
    #[serde(flatten)]
    pub options: GenerationOptions,
    pub echo: Option<bool>,
    /// Up to 5 alternatives per token.
    #[schema(minimum = 0, maximum = 5)]
    #[serde(default, deserialize_with = "whole")]
    pub logprobs: Option<i64>,
    /// Each chunk carries its token ids in `choices[].token_ids` (vLLM's
    /// extension).
    pub return_token_ids: Option<bool>,
    /// Not supported: only empty.
    #[schema(max_length = 0)]
    pub suffix: Option<String>,
}

/// `prompt`: the text, a list of token ids, or a list of either (one
/// choice per prompt, times `n`, indexed prompt by prompt). Read as JSON
/// and sorted out by [`prompts`], which names the failing prompt.
#[derive(Debug, Deserialize)]
#[serde(transparent)]
pub struct PromptInput(Value);

impl utoipa::PartialSchema for PromptInput {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::OneOfBuilder::new()
            .item(String::schema())
            .item(Vec::<u32>::schema())
            .item(Vec::<String>::schema())
            .item(Vec::<Vec<u32>>::schema())
            .into()
    }
}

impl ToSchema for PromptInput {}

#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// At least one.
    pub prompts: Vec<Prompt>,
    pub echo: bool,
    pub return_token_ids: bool,
    pub options: GenOptions,
}

impl CompletionRequest {
    /// The request in `body` (a JSON object).
    pub fn parse(body: &Value, vocab: usize) -> Result<Self, ApiError> {
        let wire: CompletionBody = GenerationOptions::read_into(body)?;
        let prompts = prompts(wire.prompt.as_ref().map(|p| &p.0), vocab)?;
        if wire.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("`suffix` is not supported", "suffix"));
        }
        let mut options = gen_options(&wire.options, vocab)?;
        if let Some(n) = wire.logprobs {
            if !(0..=5).contains(&n) {
                return Err(ApiError::invalid(
                    format!("`logprobs` must be between 0 and 5, got {n}"),
                    "logprobs",
                ));
            }
            options.sampling.logprobs = true;
            options.sampling.top_logprobs = n as u32;
        }
        Ok(CompletionRequest {
            model: wire.model.map(|m| m.0),
            prompts,
            echo: wire.echo.unwrap_or(false),
            return_token_ids: wire.return_token_ids.unwrap_or(false),
            options,
        })
    }
}

/// `prompt`: a string, token ids, or a list of either.
fn prompts(prompt: Option<&Value>, vocab: usize) -> Result<Vec<Prompt>, ApiError> {
    let ids = |items: &[Value], param: &str| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .map(|v| {
                as_int(v)
                    .filter(|&id| id >= 0 && (id as usize) < vocab)
                    .map(|id| id as u32)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            format!("`{param}` token ids must be integers in 0..{vocab}"),
                            param,
                        )
                    })
            })
            .collect()
    };
    let prompts = match prompt.filter(|p| !p.is_null()) {
        None => return Err(ApiError::invalid("`prompt` is required", "prompt")),
        Some(Value::String(s)) => vec![Prompt::Text(s.clone())],
        Some(Value::Array(items)) => match items.first() {
            None => return Err(ApiError::invalid("`prompt` is empty", "prompt")),
            Some(Value::String(_) | Value::Array(_)) => items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(s) => Ok(Prompt::Text(s.clone())),
                    Value::Array(inner) => Ok(Prompt::Tokens(ids(inner, &format!("prompt[{i}]"))?)),
                    v => Err(wrong_type(
                        &format!("prompt[{i}]"),
                        "a string or an array of token ids",
                        v,
                    )),
                })
                .collect::<Result<_, _>>()?,
            Some(_) => vec![Prompt::Tokens(ids(items, "prompt")?)],
        },
        Some(v) => {
            return Err(wrong_type(
                "prompt",
                "a string, an array of strings or an array of token ids",
                v,
            ))
        }
    };
    let single = prompts.len() == 1;
    for (i, p) in prompts.iter().enumerate() {
        let empty = match p {
            Prompt::Text(t) => t.is_empty(),
            Prompt::Tokens(t) => t.is_empty(),
        };
        if empty {
            let param = if single {
                "prompt".to_owned()
            } else {
                format!("prompt[{i}]")
            };
            return Err(ApiError::invalid(format!("`{param}` is empty"), &param));
        }
    }
    Ok(prompts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<CompletionRequest, ApiError> {
        CompletionRequest::parse(&v, 512)
    }

    #[test]
    fn prompt_shapes() {
        let prompts = |v| parse(v).unwrap().prompts;
        assert_eq!(
            prompts(json!({"prompt": "hi"})),
            [Prompt::Text("hi".into())]
        );
        assert_eq!(
            prompts(json!({"prompt": ["hi"]})),
            [Prompt::Text("hi".into())]
        );
        assert_eq!(
            prompts(json!({"prompt": [1, 2, 3]})),
            [Prompt::Tokens(vec![1, 2, 3])]
        );
        assert_eq!(
            prompts(json!({"prompt": [[4, 5]]})),
            [Prompt::Tokens(vec![4, 5])]
        );
        assert_eq!(
            prompts(json!({"prompt": ["a", [6], "b"]})),
            [
                Prompt::Text("a".into()),
                Prompt::Tokens(vec![6]),
                Prompt::Text("b".into())
            ]
        );
        let r = parse(json!({"prompt": "x", "logprobs": 2, "echo": true})).unwrap();
        assert!(r.echo && r.options.sampling.logprobs && r.options.sampling.top_logprobs == 2);
        assert!(!r.return_token_ids);
        assert!(
            parse(json!({"prompt": [1], "return_token_ids": true}))
                .unwrap()
                .return_token_ids
        );
    }

    #[test]
    fn bad_prompts() {
        for (input, param) in [
            (json!({}), "prompt"),
            (json!({"prompt": ""}), "prompt"),
            (json!({"prompt": []}), "prompt"),
            (json!({"prompt": 7}), "prompt"),
            (json!({"prompt": ["a", ""]}), "prompt[1]"),
            (json!({"prompt": [[1], []]}), "prompt[1]"),
            (json!({"prompt": ["a", 3]}), "prompt[1]"),
            (json!({"prompt": [[1], [2, 512]]}), "prompt[1]"),
            (json!({"prompt": [1, 512]}), "prompt"),
            (json!({"prompt": [1, -1]}), "prompt"),
            (json!({"prompt": [[1, "x"]]}), "prompt[0]"),
            (json!({"prompt": "x", "logprobs": 6}), "logprobs"),
            (json!({"prompt": "x", "logprobs": true}), "logprobs"),
            (json!({"prompt": "x", "suffix": "y"}), "suffix"),
            (json!({"prompt": "x", "best_of": 2}), "best_of"),
            (json!({"prompt": "x", "echo": 1}), "echo"),
            (
                json!({"prompt": "x", "return_token_ids": 1}),
                "return_token_ids",
            ),
        ] {
            let e = parse(input.clone()).unwrap_err();
            assert_eq!(e.param(), Some(param), "{input}: {e}");
        }
    }
}
