//! The generation options chat and completions share: their wire type
//! (parsed and documented), and the rules that make them the typed
//! [`GenOptions`] an engine request is built from, each rule naming its
//! field in errors.

use std::collections::BTreeMap;

use engine_core::SamplingParams;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::body::{read, whole, StringOr};
use super::structured::{self, ResponseFormat, StructuredOutput, StructuredOutputs};
use super::ApiError;

/// The options chat and completions share.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct GenerationOptions {
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "whole")]
    pub max_tokens: Option<i64>,
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "whole")]
    pub max_completion_tokens: Option<i64>,
    #[schema(minimum = 0.0, maximum = 2.0)]
    pub temperature: Option<f64>,
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f64>,
    /// -1 or 0 turn it off.
    #[schema(minimum = -1)]
    #[serde(default, deserialize_with = "whole")]
    pub top_k: Option<i64>,
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub min_p: Option<f64>,
    #[schema(minimum = -2.0, maximum = 2.0)]
    pub presence_penalty: Option<f64>,
    #[schema(minimum = -2.0, maximum = 2.0)]
    pub frequency_penalty: Option<f64>,
    #[schema(exclusive_minimum = 0.0, maximum = 2.0)]
    pub repetition_penalty: Option<f64>,
    #[serde(default, deserialize_with = "whole")]
    pub seed: Option<i64>,
    /// Token id (as a string) to a bias in [-100, 100].
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// Up to 16 strings (a single string is accepted too).
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Choices to generate (at most `server.max_n`, on completions counting
    /// every prompt's); they share the prompt's prefill through the prefix
    /// cache. Streamed choices interleave, each chunk naming its `index`.
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "whole")]
    pub n: Option<i64>,
    /// Only 1 is accepted; use `n`.
    #[schema(minimum = 1, maximum = 1)]
    #[serde(default, deserialize_with = "whole")]
    pub best_of: Option<i64>,
    /// Chat with a model that thinks: reasoning tokens allowed before the
    /// think block is closed for the model (a newline and the closing tag),
    /// after which the answer follows (mlx-vlm's server's field).
    #[schema(minimum = 0)]
    #[serde(default, deserialize_with = "whole")]
    pub thinking_budget: Option<i64>,
    /// Generate through end-of-sequence tokens (vLLM's extension).
    pub ignore_eos: Option<bool>,
    /// Decoding is constrained to the format (`json_object`, `json_schema`,
    /// strict or not). At most one of it, `structured_outputs` and the
    /// `guided_*` fields per request.
    pub response_format: Option<ResponseFormat>,
    /// Constrained decoding (vLLM's extension).
    pub structured_outputs: Option<StructuredOutputs>,
    /// A JSON Schema the output must match (vLLM's older spelling; an
    /// object or its JSON text).
    #[schema(value_type = Option<Object>)]
    pub guided_json: Option<Value>,
    /// A regular expression the whole output must match.
    pub guided_regex: Option<String>,
    /// The output is exactly one of these strings.
    #[schema(min_items = 1)]
    pub guided_choice: Option<Vec<String>>,
    /// A grammar in llguidance's Lark dialect.
    pub guided_grammar: Option<String>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// `stop`: one string or a list of up to [`MAX_STOP`].
#[derive(Debug)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl utoipa::PartialSchema for Stop {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ArrayBuilder, OneOfBuilder};
        OneOfBuilder::new()
            .item(String::schema())
            .item(
                ArrayBuilder::new()
                    .items(String::schema())
                    .max_items(Some(MAX_STOP)),
            )
            .into()
    }
}

impl ToSchema for Stop {}

impl<'de> Deserialize<'de> for Stop {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(
            match StringOr::read(d, "a string or an array of strings")? {
                StringOr::String(s) => Stop::One(s),
                StringOr::Other(list) => Stop::Many(list),
            },
        )
    }
}

/// The sampling knobs a checkpoint's defaults may fill when a request
/// leaves them out.
const DEFAULTABLE: [&str; 5] = [
    "temperature",
    "top_p",
    "min_p",
    "top_k",
    "repetition_penalty",
];

impl GenerationOptions {
    /// A request `T` that flattens these options into its own fields.
    /// serde loses the path inside a flattened struct, so the options are
    /// read on their own first: their errors keep their names.
    pub fn read_into<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
        read::<Self>(body)?;
        read(body)
    }

    fn given(&self, key: &str) -> bool {
        match key {
            "temperature" => self.temperature.is_some(),
            "top_p" => self.top_p.is_some(),
            "min_p" => self.min_p.is_some(),
            "top_k" => self.top_k.is_some(),
            "repetition_penalty" => self.repetition_penalty.is_some(),
            _ => false,
        }
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
    /// The sampling knobs the request set itself (the checkpoint's
    /// defaults fill the others).
    pub sampling_given: Vec<&'static str>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// vLLM's extension: generate through end-of-sequence tokens until
    /// `max_tokens` or a stop string (benchmarks need fixed-length outputs).
    pub ignore_eos: bool,
    /// The output's grammar (structured outputs), see [`super::structured`].
    pub structured: Option<StructuredOutput>,
}

impl GenOptions {
    /// Fills in the sampling knobs the request left out from `defaults`.
    pub fn fill_sampling(&mut self, defaults: &engine_core::SamplingDefaults) {
        let given = &self.sampling_given;
        defaults.apply(&mut self.sampling, |key| given.contains(&key));
    }
}

/// Most stop strings per request (OpenAI allows 4; a few more is harmless).
const MAX_STOP: usize = 16;

pub fn gen_options(o: &GenerationOptions, vocab: usize) -> Result<GenOptions, ApiError> {
    let n = match o.n {
        None => 1,
        Some(n) => at_least(n, 1, "n")?,
    };
    if o.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid(
            "`best_of` other than 1 is not supported; use `n` for several choices",
            "best_of",
        ));
    }
    let max_tokens = match (o.max_completion_tokens, o.max_tokens) {
        (Some(n), _) => Some(at_least(n, 1, "max_completion_tokens")?),
        (None, Some(n)) => Some(at_least(n, 1, "max_tokens")?),
        (None, None) => None,
    };
    let mut s = SamplingParams::default();
    if let Some(t) = within(o.temperature, "temperature", 0.0, 2.0, false)? {
        s.temperature = t;
    }
    if let Some(p) = within(o.top_p, "top_p", 0.0, 1.0, true)? {
        s.top_p = p;
    }
    if let Some(k) = o.top_k {
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
    if let Some(p) = within(o.min_p, "min_p", 0.0, 1.0, false)? {
        s.min_p = p;
    }
    if let Some(p) = within(o.presence_penalty, "presence_penalty", -2.0, 2.0, false)? {
        s.presence_penalty = p;
    }
    if let Some(p) = within(o.frequency_penalty, "frequency_penalty", -2.0, 2.0, false)? {
        s.frequency_penalty = p;
    }
    if let Some(p) = within(o.repetition_penalty, "repetition_penalty", 0.0, 2.0, true)? {
        s.repetition_penalty = p;
    }
    // Negative seeds are valid in OpenAI's API; keep their bits.
    s.seed = o.seed.map(|seed| seed as u64);
    if let Some(bias) = &o.logit_bias {
        s.logit_bias = logit_bias(bias, vocab)?;
    }
    let thinking_budget = o
        .thinking_budget
        .map(|b| at_least(b, 0, "thinking_budget"))
        .transpose()?;
    Ok(GenOptions {
        n,
        thinking_budget,
        max_tokens,
        sampling: s,
        sampling_given: DEFAULTABLE.into_iter().filter(|k| o.given(k)).collect(),
        stop: stop_strings(o.stop.as_ref())?,
        stream: o.stream.unwrap_or(false),
        include_usage: o
            .stream_options
            .as_ref()
            .and_then(|so| so.include_usage)
            .unwrap_or(false),
        ignore_eos: o.ignore_eos.unwrap_or(false),
        structured: structured_output(o)?,
    })
}

/// A count of at least `min`.
fn at_least(n: i64, min: i64, param: &str) -> Result<u32, ApiError> {
    if n < min {
        return Err(ApiError::invalid(
            format!("`{param}` must be at least {min}, got {n}"),
            param,
        ));
    }
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

/// A number within `lo..=hi` (`lo_open`: `lo` itself excluded).
fn within(
    x: Option<f64>,
    param: &str,
    lo: f64,
    hi: f64,
    lo_open: bool,
) -> Result<Option<f32>, ApiError> {
    let Some(x) = x else {
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
            format!("`{param}` must be {low} and at most {hi}, got {x}"),
            param,
        ));
    }
    Ok(Some(x as f32))
}

/// Keys are token ids written as strings (`{"50256": -100}`).
fn logit_bias(map: &BTreeMap<String, f64>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut out = Vec::with_capacity(map.len());
    for (key, &bias) in map {
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
        if !(-100.0..=100.0).contains(&bias) {
            let param = format!("logit_bias.{key}");
            return Err(ApiError::invalid(
                format!("`{param}` must be between -100 and 100, got {bias}"),
                param,
            ));
        }
        out.push((id, bias as f32));
    }
    Ok(out)
}

fn stop_strings(stop: Option<&Stop>) -> Result<Vec<String>, ApiError> {
    let stops = match stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(list)) => list.clone(),
    };
    if stops.len() > MAX_STOP {
        return Err(ApiError::invalid(
            format!("`stop` may hold at most {MAX_STOP} strings"),
            "stop",
        ));
    }
    Ok(stops.into_iter().filter(|s| !s.is_empty()).collect())
}

/// The request's structured-output constraint, if any: at most one of
/// `response_format` (of type `text` or absent, it constrains nothing),
/// `structured_outputs` and the `guided_*` fields.
fn structured_output(o: &GenerationOptions) -> Result<Option<StructuredOutput>, ApiError> {
    let mut found: Vec<StructuredOutput> = Vec::new();
    if let Some(format) = &o.response_format {
        found.extend(format.constraint("response_format")?);
    }
    if let Some(so) = &o.structured_outputs {
        found.extend(so.constraints()?);
    }
    if let Some(v) = &o.guided_json {
        found.push(StructuredOutput::json_schema(v, "guided_json")?);
    }
    if let Some(rx) = &o.guided_regex {
        found.push(StructuredOutput::regex(rx, "guided_regex"));
    }
    if let Some(list) = &o.guided_choice {
        found.push(StructuredOutput::choice(list, "guided_choice")?);
    }
    if let Some(lark) = &o.guided_grammar {
        found.push(StructuredOutput::lark(lark, "guided_grammar"));
    }
    structured::one_of(found)
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

    fn options(v: Value) -> Result<GenOptions, ApiError> {
        gen_options(&read(&v)?, 512)
    }

    fn err(v: Value) -> ApiError {
        options(v).unwrap_err()
    }

    #[test]
    fn defaults_and_unknown_fields() {
        let o = options(json!({"whatever": [1, 2], "user": "u", "temperature": null})).unwrap();
        assert_eq!(o.max_tokens, None);
        assert_eq!(o.sampling, SamplingParams::default());
        assert!(o.stop.is_empty() && !o.stream && !o.include_usage && !o.ignore_eos);
    }

    #[test]
    fn typed_fields() {
        let o = options(json!({
                "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0.7, "top_p": 0.9,
                "top_k": -1, "min_p": 0.05, "seed": -3, "presence_penalty": 0.5,
                "frequency_penalty": -0.5, "repetition_penalty": 1.1, "logit_bias": {"7": -100, "9": 2.5},
                "stop": "END", "stream": true, "stream_options": {"include_usage": true}, "n": 1,
                "ignore_eos": true
        }))
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
        assert_eq!(options(json!({"n": 3, "max_tokens": 2.0})).unwrap().n, 3);
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
