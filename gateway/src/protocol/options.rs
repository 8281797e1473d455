//! Parse, don't validate: the raw JSON body is read field by field into
//! typed values, each failure naming its field in `error.param`. Unknown
//! fields are ignored, as OpenAI does; `null` counts as absent.

use engine_core::SamplingParams;
use serde_json::{Map, Value};

use super::structured::StructuredOutput;
use super::ApiError;

/// A request body known to be a JSON object.
pub struct RawBody {
    map: Map<String, Value>,
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub fn wrong_type(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        format!("`{param}` must be {expected}, got {}", type_name(got)),
        param,
    )
}

impl RawBody {
    pub fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(ApiError::invalid_no_param(
                "The request body is empty; expected a JSON object",
            ));
        }
        let value: Value = serde_json::from_slice(bytes).map_err(|e| {
            ApiError::invalid_no_param(format!("The request body is not valid JSON: {e}"))
        })?;
        match value {
            Value::Object(map) => Ok(Self { map }),
            other => Err(ApiError::invalid_no_param(format!(
                "The request body must be a JSON object, got {}",
                type_name(&other)
            ))),
        }
    }

    /// A body built by the gateway itself (another endpoint's request in
    /// this one's terms).
    pub fn from_map(map: Map<String, Value>) -> Self {
        Self { map }
    }

    /// The field, unless absent or null.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    /// Fills in the sampling knobs this body leaves out from `defaults`.
    pub fn fill_sampling(
        &self,
        defaults: &engine_core::SamplingDefaults,
        sampling: &mut engine_core::SamplingParams,
    ) {
        defaults.apply(sampling, |key| self.get(key).is_some());
    }

    pub fn string(&self, key: &str) -> Result<Option<&str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong_type(key, "a string", v)),
        }
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(wrong_type(key, "a boolean", v)),
        }
    }

    pub fn int(&self, key: &str) -> Result<Option<i64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => as_int(v)
                .map(Some)
                .ok_or_else(|| wrong_type(key, "an integer", v)),
        }
    }

    pub fn number(&self, key: &str) -> Result<Option<f64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(v) => Err(wrong_type(key, "a number", v)),
        }
    }

    /// A number within `lo..=hi` (`lo_open`: `lo` itself excluded).
    pub fn number_in(
        &self,
        key: &str,
        lo: f64,
        hi: f64,
        lo_open: bool,
    ) -> Result<Option<f32>, ApiError> {
        let Some(x) = self.number(key)? else {
            return Ok(None);
        };
        let low_ok = if lo_open { x > lo } else { x >= lo };
        if !(low_ok && x <= hi) {
            let low = if lo_open {
                format!("greater than {lo}")
            } else {
                format!("at least {lo}")
            };
            return Err(ApiError::invalid(
                format!("`{key}` must be {low} and at most {hi}, got {x}"),
                key,
            ));
        }
        Ok(Some(x as f32))
    }

    pub fn object(&self, key: &str) -> Result<Option<&Map<String, Value>>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(v) => Err(wrong_type(key, "an object", v)),
        }
    }

    pub fn array(&self, key: &str) -> Result<Option<&Vec<Value>>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(wrong_type(key, "an array", v)),
        }
    }
}

/// Integers only: `1.5` is not a token count (but `2.0` is accepted).
pub fn as_int(v: &Value) -> Option<i64> {
    match v {
        Value::Number(n) => n.as_i64().or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
                .map(|f| f as i64)
        }),
        _ => None,
    }
}

/// Generation options common to chat and completions.
#[derive(Debug, Clone, PartialEq)]
pub struct GenOptions {
    /// Choices per prompt (`server.max_n` bounds it, in the handler).
    pub n: u32,
    /// Most tokens a thinking model may reason for before its think block
    /// is closed for it (chat on models that think; as mlx-vlm's server).
    pub thinking_budget: Option<u32>,
    /// `None`: fill the rest of the context (capped by the config).
    pub max_tokens: Option<u32>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// vLLM's extension: generate through end-of-sequence tokens until
    /// `max_tokens` or a stop string (benchmarks need fixed-length outputs).
    pub ignore_eos: bool,
    /// The output's grammar (structured outputs), see [`super::structured`].
    pub structured: Option<StructuredOutput>,
}

/// `n` choices for each of `prompts` prompts within `server.max_n`; the
/// error names `n`, or `prompt` when the list is what makes it too many.
pub fn check_choices(n: u32, prompts: usize, max_n: u32) -> Result<(), ApiError> {
    if n > max_n {
        return Err(ApiError::invalid(
            format!("`n` must be at most {max_n} on this server, got {n}"),
            "n",
        ));
    }
    if (n as usize).saturating_mul(prompts) > max_n as usize {
        return Err(ApiError::invalid(
            format!("{prompts} prompts x n = {n} make more than the {max_n} choices this server allows per request"),
            "prompt",
        ));
    }
    Ok(())
}

/// Most stop strings per request (OpenAI allows 4; a few more is harmless).
const MAX_STOP: usize = 16;

pub fn gen_options(body: &RawBody, vocab: usize) -> Result<GenOptions, ApiError> {
    let n = match body.int("n")? {
        None => 1,
        Some(n) if n < 1 => {
            return Err(ApiError::invalid(
                format!("`n` must be at least 1, got {n}"),
                "n",
            ))
        }
        Some(n) => u32::try_from(n).unwrap_or(u32::MAX),
    };
    match body.int("best_of")? {
        None | Some(1) => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "`best_of` other than 1 is not supported; use `n` for several choices",
                "best_of",
            ))
        }
    }
    let max_tokens = match body.int("max_completion_tokens")? {
        Some(n) => Some(positive_tokens(n, "max_completion_tokens")?),
        None => body
            .int("max_tokens")?
            .map(|n| positive_tokens(n, "max_tokens"))
            .transpose()?,
    };
    let mut s = SamplingParams::default();
    if let Some(t) = body.number_in("temperature", 0.0, 2.0, false)? {
        s.temperature = t;
    }
    if let Some(p) = body.number_in("top_p", 0.0, 1.0, true)? {
        s.top_p = p;
    }
    if let Some(k) = body.int("top_k")? {
        // -1 is vLLM's spelling of "disabled".
        s.top_k = match k {
            -1 | 0 => 0,
            k if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
            _ => {
                return Err(ApiError::invalid(
                    format!("`top_k` must be -1, 0 or positive, got {k}"),
                    "top_k",
                ))
            }
        };
    }
    if let Some(p) = body.number_in("min_p", 0.0, 1.0, false)? {
        s.min_p = p;
    }
    if let Some(p) = body.number_in("presence_penalty", -2.0, 2.0, false)? {
        s.presence_penalty = p;
    }
    if let Some(p) = body.number_in("frequency_penalty", -2.0, 2.0, false)? {
        s.frequency_penalty = p;
    }
    if let Some(p) = body.number_in("repetition_penalty", 0.0, 2.0, true)? {
        s.repetition_penalty = p;
    }
    if let Some(seed) = body.int("seed")? {
        // Negative seeds are valid in OpenAI's API; keep their bits.
        s.seed = Some(seed as u64);
    }
    if let Some(bias) = body.object("logit_bias")? {
        s.logit_bias = logit_bias(bias, vocab)?;
    }
    let stop = stop_strings(body)?;
    let stream = body.bool("stream")?.unwrap_or(false);
    let include_usage = match body.object("stream_options")? {
        Some(opts) => match opts.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(wrong_type("stream_options.include_usage", "a boolean", v)),
        },
        None => false,
    };
    let ignore_eos = body.bool("ignore_eos")?.unwrap_or(false);
    let thinking_budget = match body.int("thinking_budget")? {
        None => None,
        Some(b) if b < 0 => {
            return Err(ApiError::invalid(
                format!("`thinking_budget` must be 0 or more, got {b}"),
                "thinking_budget",
            ))
        }
        Some(b) => Some(u32::try_from(b).unwrap_or(u32::MAX)),
    };
    let structured = super::structured::parse(body)?;
    Ok(GenOptions {
        n,
        thinking_budget,
        max_tokens,
        sampling: s,
        stop,
        stream,
        include_usage,
        ignore_eos,
        structured,
    })
}

fn positive_tokens(n: i64, param: &str) -> Result<u32, ApiError> {
    if n < 1 {
        return Err(ApiError::invalid(
            format!("`{param}` must be at least 1, got {n}"),
            param,
        ));
    }
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

/// Keys are token ids written as strings (`{"50256": -100}`).
fn logit_bias(map: &Map<String, Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut out = Vec::with_capacity(map.len());
    for (key, value) in map {
        let param = format!("logit_bias.{key}");
        let id: u32 = key
            .parse()
            .ok()
            .filter(|&id: &u32| (id as usize) < vocab)
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("`logit_bias` keys must be token ids below {vocab} written as strings, got {key:?}"),
                    "logit_bias",
                )
            })?;
        let bias = value
            .as_f64()
            .ok_or_else(|| wrong_type(&param, "a number", value))?;
        if !(-100.0..=100.0).contains(&bias) {
            return Err(ApiError::invalid(
                format!("`{param}` must be between -100 and 100, got {bias}"),
                param,
            ));
        }
        out.push((id, bias as f32));
    }
    Ok(out)
}

fn stop_strings(body: &RawBody) -> Result<Vec<String>, ApiError> {
    let stops = match body.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                other => Err(wrong_type(&format!("stop[{i}]"), "a string", other)),
            })
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(wrong_type("stop", "a string or an array of strings", v)),
    };
    if stops.len() > MAX_STOP {
        return Err(ApiError::invalid(
            format!("`stop` may hold at most {MAX_STOP} strings"),
            "stop",
        ));
    }
    Ok(stops.into_iter().filter(|s| !s.is_empty()).collect())
}

/// What bounds a request's length.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub context_window: usize,
    /// Cap on the default when a request names no max_tokens.
    pub default_max_tokens: u32,
    /// Tokens the whole KV pool can hold.
    pub pool_tokens: usize,
}

/// Checks prompt + max_tokens against the context window; picks the
/// default max_tokens (the rest of the context, capped) when none is given.
pub fn resolve_max_tokens(
    prompt_len: usize,
    requested: Option<u32>,
    limits: &Limits,
    prompt_param: &str,
    max_param: &str,
) -> Result<u32, ApiError> {
    let window = limits.context_window.min(limits.pool_tokens);
    if prompt_len >= window {
        return Err(ApiError::context_length(
            format!(
                "This model's maximum context length is {window} tokens, but the prompt has {prompt_len} tokens"
            ),
            prompt_param,
        ));
    }
    let room = window - prompt_len;
    match requested {
        Some(n) if n as usize > room => Err(ApiError::context_length(
            format!(
                "This model's maximum context length is {window} tokens, but {} tokens were requested \
                 ({prompt_len} in the prompt, {n} for the completion); reduce the prompt or `{max_param}`",
                prompt_len + n as usize
            ),
            max_param,
        )),
        Some(n) => Ok(n),
        None => Ok((room as u64).min(limits.default_max_tokens as u64) as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> RawBody {
        RawBody::parse(v.to_string().as_bytes()).unwrap()
    }

    fn err(v: Value) -> ApiError {
        gen_options(&body(v), 512).unwrap_err()
    }

    #[test]
    fn parse_rejects_non_objects() {
        for raw in ["", "  ", "{", "[1]", "3", "\"x\""] {
            let e = RawBody::parse(raw.as_bytes()).err().unwrap();
            assert_eq!(e.status().as_u16(), 400, "{raw}");
            assert_eq!(e.param(), None);
        }
    }

    #[test]
    fn defaults_and_unknown_fields() {
        let o = gen_options(
            &body(json!({"whatever": [1, 2], "user": "u", "temperature": null})),
            512,
        )
        .unwrap();
        assert_eq!(o.max_tokens, None);
        assert_eq!(o.sampling, SamplingParams::default());
        assert!(o.stop.is_empty() && !o.stream && !o.include_usage && !o.ignore_eos);
    }

    #[test]
    fn typed_fields() {
        let o = gen_options(
            &body(json!({
                "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0.7, "top_p": 0.9,
                "top_k": -1, "min_p": 0.05, "seed": -3, "presence_penalty": 0.5,
                "frequency_penalty": -0.5, "repetition_penalty": 1.1, "logit_bias": {"7": -100, "9": 2.5},
                "stop": "END", "stream": true, "stream_options": {"include_usage": true}, "n": 1,
                "ignore_eos": true
            })),
            512,
        )
        .unwrap();
        assert_eq!(o.max_tokens, Some(7));
        assert_eq!(o.sampling.temperature, 0.7);
        assert_eq!(o.sampling.top_k, 0);
        assert_eq!(o.sampling.seed, Some(-3i64 as u64));
        assert_eq!(o.sampling.logit_bias, vec![(7, -100.0), (9, 2.5)]);
        assert_eq!(o.stop, vec!["END".to_string()]);
        assert!(o.stream && o.include_usage && o.ignore_eos);
        assert!(!o.sampling.is_greedy() && o.sampling.has_penalties());
    }

    #[test]
    fn wrong_types_and_ranges_name_the_param() {
        let cases = [
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"temperature": 2.5}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_k": -2}), "top_k"),
            (json!({"top_k": 1.5}), "top_k"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (json!({"max_tokens": -4}), "max_tokens"),
            (json!({"max_tokens": "10"}), "max_tokens"),
            (json!({"max_completion_tokens": 0}), "max_completion_tokens"),
            (json!({"n": 0}), "n"),
            (json!({"n": 1.5}), "n"),
            (json!({"best_of": 2}), "best_of"),
            (json!({"thinking_budget": -1}), "thinking_budget"),
            (json!({"thinking_budget": "lots"}), "thinking_budget"),
            (json!({"stop": 3}), "stop"),
            (json!({"stop": ["a", 1]}), "stop[1]"),
            (json!({"stream": "yes"}), "stream"),
            (json!({"ignore_eos": 1}), "ignore_eos"),
            (
                json!({"stream_options": {"include_usage": 1}}),
                "stream_options.include_usage",
            ),
            (json!({"logit_bias": {"abc": 1}}), "logit_bias"),
            (json!({"logit_bias": {"600": 1}}), "logit_bias"),
            (json!({"logit_bias": {"5": 101}}), "logit_bias.5"),
            (json!({"logit_bias": []}), "logit_bias"),
            (json!({"presence_penalty": 3}), "presence_penalty"),
            (json!({"repetition_penalty": 0}), "repetition_penalty"),
            (json!({"seed": "x"}), "seed"),
        ];
        for (input, param) in cases {
            let e = err(input.clone());
            assert_eq!(e.status().as_u16(), 400, "{input}");
            assert_eq!(e.kind(), "invalid_request_error");
            assert_eq!(e.param(), Some(param), "{input}: {e}");
        }
        assert_eq!(gen_options(&body(json!({"n": 3})), 512).unwrap().n, 3);
    }

    #[test]
    fn context_window_and_default_max_tokens() {
        let limits = Limits {
            context_window: 100,
            default_max_tokens: 30,
            pool_tokens: 1000,
        };
        assert_eq!(
            resolve_max_tokens(10, None, &limits, "messages", "max_tokens").unwrap(),
            30
        );
        assert_eq!(
            resolve_max_tokens(80, None, &limits, "messages", "max_tokens").unwrap(),
            20
        );
        assert_eq!(
            resolve_max_tokens(10, Some(90), &limits, "messages", "max_tokens").unwrap(),
            90
        );
        let e = resolve_max_tokens(10, Some(91), &limits, "messages", "max_tokens").unwrap_err();
        assert_eq!(
            (e.param(), e.code()),
            (Some("max_tokens"), Some("context_length_exceeded"))
        );
        let e = resolve_max_tokens(100, None, &limits, "messages", "max_tokens").unwrap_err();
        assert_eq!(e.param(), Some("messages"));
        // A pool smaller than the window bounds the default too.
        let small = Limits {
            pool_tokens: 50,
            ..limits
        };
        assert_eq!(
            resolve_max_tokens(40, None, &small, "prompt", "max_tokens").unwrap(),
            10
        );
    }
}
