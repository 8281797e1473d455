//! The completions request: a raw prompt (text or token ids), or a list
//! of them, and the generation options.

use serde_json::Value;

use super::options::{as_int, gen_options, wrong_type, GenOptions, RawBody};
use super::ApiError;

/// A prompt as text or as token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

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
    pub fn parse(body: &RawBody, vocab: usize) -> Result<Self, ApiError> {
        let model = body.string("model")?.map(str::to_owned);
        let prompts = prompts(body, vocab)?;
        let echo = body.bool("echo")?.unwrap_or(false);
        let return_token_ids = body.bool("return_token_ids")?.unwrap_or(false);
        if body.string("suffix")?.is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("`suffix` is not supported", "suffix"));
        }
        let mut options = gen_options(body, vocab)?;
        if let Some(n) = body.int("logprobs")? {
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
            model,
            prompts,
            echo,
            return_token_ids,
            options,
        })
    }
}

/// `prompt`: a string, token ids, or a list of either.
fn prompts(body: &RawBody, vocab: usize) -> Result<Vec<Prompt>, ApiError> {
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
    let prompts = match body.get("prompt") {
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
        CompletionRequest::parse(&RawBody::parse(v.to_string().as_bytes()).unwrap(), 512)
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
