//! Structured outputs: the request fields that constrain decoding to a
//! grammar, read into one [`StructuredOutput`]. OpenAI's
//! `response_format: {"type": "json_schema" | "json_object"}` (enforced
//! either way; `strict: true` also closes every object schema that leaves
//! `additionalProperties` unset, as OpenAI's strict mode does), and vLLM's `structured_outputs` ({`json`, `regex`,
//! `choice`, `grammar`, `json_object`}) and older `guided_json`,
//! `guided_regex`, `guided_choice`, `guided_grammar`. A request gives at
//! most one of them. Schemas are checked against the JSON Schema
//! meta-schema here; whether the grammar compiles is checked in the
//! prepare stage, against the model's tokenizer.

use engine_core::Grammar;
use serde_json::{Map, Value};

use super::options::{wrong_type, RawBody};
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

/// The request's structured-output constraint, if any. `response_format`
/// of type `text` (or absent) constrains nothing.
pub fn parse(body: &RawBody) -> Result<Option<StructuredOutput>, ApiError> {
    let mut found: Vec<StructuredOutput> = Vec::new();
    if let Some(format) = body.object("response_format")? {
        found.extend(response_format(format, "response_format")?);
    }
    if let Some(so) = body.object("structured_outputs")? {
        found.extend(structured_outputs(so)?);
    }
    if let Some(v) = body.get("guided_json") {
        found.push(StructuredOutput::json_schema(v, "guided_json")?);
    }
    if let Some(rx) = body.string("guided_regex")? {
        found.push(StructuredOutput::new(
            Grammar::Regex(rx.into()),
            "guided_regex",
        ));
    }
    if let Some(v) = body.get("guided_choice") {
        found.push(StructuredOutput::new(
            Grammar::Choice(choices(v, "guided_choice")?),
            "guided_choice",
        ));
    }
    if let Some(lark) = body.string("guided_grammar")? {
        found.push(StructuredOutput::new(
            Grammar::Lark(lark.into()),
            "guided_grammar",
        ));
    }
    one_of(found)
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

/// OpenAI's `response_format` (chat) or `text.format` (responses, where
/// the schema's fields sit beside `type` instead of under `json_schema`).
pub fn response_format(
    format: &Map<String, Value>,
    at: &str,
) -> Result<Option<StructuredOutput>, ApiError> {
    let type_param = format!("{at}.type");
    match format.get("type") {
        Some(Value::String(t)) if t == "text" => Ok(None),
        Some(Value::String(t)) if t == "json_object" => Ok(Some(StructuredOutput::json_object(at))),
        Some(Value::String(t)) if t == "json_schema" => {
            // Chat nests the schema under `json_schema`; responses do not.
            let (spec, spec_at) = match format.get("json_schema") {
                Some(Value::Object(spec)) => (spec, format!("{at}.json_schema")),
                Some(v) => return Err(wrong_type(&format!("{at}.json_schema"), "an object", v)),
                None if at == "response_format" => {
                    return Err(ApiError::invalid(
                        format!("`{at}.json_schema` is required for type \"json_schema\""),
                        format!("{at}.json_schema"),
                    ))
                }
                None => (format, at.to_owned()),
            };
            let strict = match spec.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => return Err(wrong_type(&format!("{spec_at}.strict"), "a boolean", v)),
            };
            let schema_at = format!("{spec_at}.schema");
            match spec.get("schema") {
                Some(schema) if !schema.is_null() => {
                    StructuredOutput::schema(schema, &schema_at, strict).map(Some)
                }
                _ => Err(ApiError::invalid(
                    format!("`{schema_at}` is required for type \"json_schema\""),
                    schema_at,
                )),
            }
        }
        _ => Err(ApiError::invalid(
            format!("`{type_param}` must be \"text\", \"json_object\" or \"json_schema\""),
            type_param,
        )),
    }
}

/// vLLM's `structured_outputs`: exactly one of its constraint keys.
fn structured_outputs(so: &Map<String, Value>) -> Result<Vec<StructuredOutput>, ApiError> {
    let mut found = Vec::new();
    for (key, v) in so.iter().filter(|(_, v)| !v.is_null()) {
        let param = format!("structured_outputs.{key}");
        let string = |v: &Value| match v {
            Value::String(s) => Ok(s.clone()),
            other => Err(wrong_type(&param, "a string", other)),
        };
        match key.as_str() {
            "json" => found.push(StructuredOutput::json_schema(v, &param)?),
            "regex" => found.push(StructuredOutput::new(Grammar::Regex(string(v)?), &param)),
            "grammar" => found.push(StructuredOutput::new(Grammar::Lark(string(v)?), &param)),
            "choice" => found.push(StructuredOutput::new(
                Grammar::Choice(choices(v, &param)?),
                &param,
            )),
            "json_object" => match v {
                Value::Bool(true) => found.push(StructuredOutput::json_object(&param)),
                Value::Bool(false) => {}
                other => return Err(wrong_type(&param, "a boolean", other)),
            },
            _ => {
                return Err(ApiError::invalid(
                    format!(
                        "`{param}` is not supported (json, regex, choice, grammar, json_object)"
                    ),
                    param,
                ))
            }
        }
    }
    Ok(found)
}

fn choices(v: &Value, param: &str) -> Result<Vec<String>, ApiError> {
    let list = v
        .as_array()
        .ok_or_else(|| wrong_type(param, "an array of strings", v))?;
    if list.is_empty() {
        return Err(ApiError::invalid(
            format!("`{param}` must list at least one choice"),
            param,
        ));
    }
    list.iter()
        .map(|c| {
            c.as_str()
                .map(str::to_owned)
                .ok_or_else(|| wrong_type(param, "an array of strings", v))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_json(v: Value) -> Result<Option<StructuredOutput>, ApiError> {
        parse(&RawBody::parse(v.to_string().as_bytes()).unwrap())
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
