//! Structured outputs: the request fields that constrain decoding to a
//! grammar, read into one [`StructuredOutput`]. OpenAI's
//! `response_format: {"type": "json_schema" | "json_object"}` (enforced
//! either way; `strict: true` also closes every object schema that leaves
//! `additionalProperties` unset, as OpenAI's strict mode does), and vLLM's
//! `structured_outputs` ({`json`, `regex`, `choice`, `grammar`,
//! `json_object`}) and older `guided_json`, `guided_regex`,
//! `guided_choice`, `guided_grammar` (fields of
//! [`super::options::GenerationOptions`]). A request gives at most one of
//! them. Schemas are checked against the JSON Schema meta-schema here;
//! whether the grammar compiles is checked in the prepare stage, against
//! the model's tokenizer.

use engine_core::Grammar;
use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::body::wrong_type;
use super::ApiError;

/// A grammar and the request field it came from (named in errors).
#[derive(Debug, Clone, PartialEq)]
pub struct StructuredOutput {
    pub grammar: Grammar,
    pub param: String,
}

impl StructuredOutput {
    fn new(grammar: Grammar, param: impl Into<String>) -> Self {
        Self {
            grammar,
            param: param.into(),
        }
    }

    /// `json_object`: any JSON object.
    pub fn json_object(param: &str) -> Self {
        Self::new(Grammar::JsonSchema(r#"{"type":"object"}"#.into()), param)
    }

    pub fn regex(regex: &str, param: &str) -> Self {
        Self::new(Grammar::Regex(regex.into()), param)
    }

    pub fn lark(grammar: &str, param: &str) -> Self {
        Self::new(Grammar::Lark(grammar.into()), param)
    }

    /// Exactly one of `choices`, which may not be empty.
    pub fn choice(choices: &[String], param: &str) -> Result<Self, ApiError> {
        if choices.is_empty() {
            return Err(ApiError::invalid(
                format!("`{param}` must list at least one choice"),
                param,
            ));
        }
        Ok(Self::new(Grammar::Choice(choices.to_vec()), param))
    }

    /// A JSON Schema given as an object (or a boolean), or as its JSON text.
    pub fn json_schema(raw: &Value, param: &str) -> Result<Self, ApiError> {
        Self::schema(raw, param, false)
    }

    /// `strict` closes every object schema that does not say otherwise
    /// (`additionalProperties: false`), as OpenAI's strict mode reads it.
    fn schema(raw: &Value, param: &str, strict: bool) -> Result<Self, ApiError> {
        let schema = match raw {
            Value::String(text) => serde_json::from_str(text).map_err(|e| {
                ApiError::invalid(format!("`{param}` is not valid JSON: {e}"), param)
            })?,
            other => other.clone(),
        };
        if !(schema.is_object() || schema.is_boolean()) {
            return Err(wrong_type(param, "a JSON Schema object", &schema));
        }
        if let Err(e) = jsonschema::meta::validate(&schema) {
            return Err(ApiError::invalid(
                format!("`{param}` is not a valid JSON Schema: {e}"),
                param,
            ));
        }
        let schema = if strict {
            grammar::closed(&schema)
        } else {
            schema
        };
        Ok(Self::new(Grammar::JsonSchema(schema.to_string()), param))
    }
}

/// At most one constraint per request.
pub fn one_of(mut found: Vec<StructuredOutput>) -> Result<Option<StructuredOutput>, ApiError> {
    if found.len() > 1 {
        let (first, second) = (&found[0].param, &found[1].param);
        return Err(ApiError::invalid(
            format!("`{second}` conflicts with `{first}`: give one structured-output constraint"),
            second.clone(),
        ));
    }
    Ok(found.pop())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FormatType {
    Text,
    JsonObject,
    JsonSchema,
}

/// OpenAI's `response_format`. Decoding is constrained to the format.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: FormatType,
    /// Required for "json_schema".
    pub json_schema: Option<JsonSchemaFormat>,
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub description: Option<String>,
    /// The JSON Schema (checked against the meta-schema, then compiled).
    #[schema(value_type = Object, required = true)]
    pub schema: Option<Value>,
    pub strict: Option<bool>,
}

impl ResponseFormat {
    /// The constraint, `at` naming this field in errors.
    pub fn constraint(&self, at: &str) -> Result<Option<StructuredOutput>, ApiError> {
        let spec_at = format!("{at}.json_schema");
        let spec = match (&self.json_schema, self.kind) {
            (Some(spec), _) => Some((spec.schema.as_ref(), spec.strict)),
            (None, FormatType::JsonSchema) => {
                return Err(ApiError::invalid(
                    format!("`{spec_at}` is required for type \"json_schema\""),
                    spec_at,
                ))
            }
            (None, _) => None,
        };
        format_constraint(self.kind, spec, at, &spec_at)
    }
}

/// A format's constraint: `json_schema`'s schema (`schema` and `strict` as
/// given, at `spec_at`) or any JSON object; `text` constrains nothing.
pub fn format_constraint(
    kind: FormatType,
    spec: Option<(Option<&Value>, Option<bool>)>,
    at: &str,
    spec_at: &str,
) -> Result<Option<StructuredOutput>, ApiError> {
    match kind {
        FormatType::Text => Ok(None),
        FormatType::JsonObject => Ok(Some(StructuredOutput::json_object(at))),
        FormatType::JsonSchema => {
            let schema_at = format!("{spec_at}.schema");
            match spec {
                Some((Some(schema), strict)) => {
                    StructuredOutput::schema(schema, &schema_at, strict.unwrap_or(false)).map(Some)
                }
                _ => Err(ApiError::invalid(
                    format!("`{schema_at}` is required for type \"json_schema\""),
                    schema_at,
                )),
            }
        }
    }
}

/// vLLM's `structured_outputs`: one of its fields.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputs {
    /// A JSON Schema (object, or its JSON text).
    #[schema(value_type = Option<Object>)]
    pub json: Option<Value>,
    pub regex: Option<String>,
    #[schema(min_items = 1)]
    pub choice: Option<Vec<String>>,
    /// Lark grammar (llguidance's dialect).
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
}

impl StructuredOutputs {
    pub fn constraints(&self) -> Result<Vec<StructuredOutput>, ApiError> {
        let at = |key: &str| format!("structured_outputs.{key}");
        let mut found = Vec::new();
        if let Some(v) = &self.json {
            found.push(StructuredOutput::json_schema(v, &at("json"))?);
        }
        if let Some(rx) = &self.regex {
            found.push(StructuredOutput::regex(rx, &at("regex")));
        }
        if let Some(list) = &self.choice {
            found.push(StructuredOutput::choice(list, &at("choice"))?);
        }
        if let Some(lark) = &self.grammar {
            found.push(StructuredOutput::lark(lark, &at("grammar")));
        }
        if self.json_object == Some(true) {
            found.push(StructuredOutput::json_object(&at("json_object")));
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_json(v: Value) -> Result<Option<StructuredOutput>, ApiError> {
        crate::protocol::options::gen_options(&crate::protocol::body::read(&v)?, 512)
            .map(|o| o.structured)
    }

    #[test]
    fn every_spelling_gives_one_grammar() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (json!({"guided_json": schema.to_string()}), "guided_json"),
            (json!({"guided_regex": "[a-z]+"}), "guided_regex"),
            (json!({"guided_choice": ["a", "b"]}), "guided_choice"),
            (json!({"guided_grammar": "start: \"x\""}), "guided_grammar"),
            (
                json!({"structured_outputs": {"json": schema}}),
                "structured_outputs.json",
            ),
            (
                json!({"structured_outputs": {"choice": ["a"]}}),
                "structured_outputs.choice",
            ),
        ];
        for (body, param) in cases {
            let s = parse_json(body.clone())
                .unwrap()
                .unwrap_or_else(|| panic!("{body}"));
            assert_eq!(s.param, param);
        }
        assert_eq!(
            parse_json(json!({"response_format": {"type": "text"}})).unwrap(),
            None
        );
        assert_eq!(parse_json(json!({})).unwrap(), None);
    }

    #[test]
    fn strict_closes_objects() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let grammar_of = |strict: bool| {
            let body = json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}});
            match parse_json(body).unwrap().unwrap().grammar {
                Grammar::JsonSchema(text) => serde_json::from_str::<Value>(&text).unwrap(),
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(grammar_of(true)["additionalProperties"], false);
        assert!(grammar_of(false).get("additionalProperties").is_none());
    }

    #[test]
    fn bad_constraints_name_their_param() {
        let cases = [
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format.type",
            ),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_choice": "a"}), "guided_choice"),
            (
                json!({"structured_outputs": {"xml": "x"}}),
                "structured_outputs.xml",
            ),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
            ),
        ];
        for (body, param) in cases {
            let e = parse_json(body.clone()).unwrap_err();
            assert_eq!(e.status().as_u16(), 400, "{body}");
            assert_eq!(e.param(), Some(param), "{body}");
        }
    }
}
