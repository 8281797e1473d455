//! A request body read into its wire type. Anything but a JSON object is a
//! 400 without `param`; a field of the wrong type, or a required one
//! missing, is a 400 whose `param` is the field's path
//! (`messages[2].content`, `tools[0].function.parameters`). Unknown fields
//! are ignored, as OpenAI does; `null` counts as absent.

use serde::de::DeserializeOwned;
use serde_json::Value;
use serde_path_to_error::Segment;

use super::ApiError;

/// The body as a JSON object.
pub fn object(bytes: &[u8]) -> Result<Value, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid_no_param(
            "The request body is empty; expected a JSON object",
        ));
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::invalid_no_param(format!("The request body is not valid JSON: {e}"))
    })?;
    if !value.is_object() {
        return Err(ApiError::invalid_no_param(format!(
            "The request body must be a JSON object, got {}",
            type_name(&value)
        )));
    }
    Ok(value)
}

/// `body` read as `T`, a failure naming its field.
pub fn read<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = path_of(e.path());
        invalid(&path, &e.into_inner().to_string())
    })
}

fn path_of(path: &serde_path_to_error::Path) -> String {
    let mut out = String::new();
    for segment in path {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } if out.is_empty() => out.push_str(key),
            Segment::Map { key } => {
                out.push('.');
                out.push_str(key);
            }
            Segment::Enum { .. } | Segment::Unknown => {}
        }
    }
    out
}

/// serde's message in the API's words: `invalid type: string "x",
/// expected f64` becomes "`temperature` must be a number, got a string",
/// an unknown variant "`role` must be one of ..., got `wizard`"; a missing
/// field is named itself.
fn invalid(path: &str, message: &str) -> ApiError {
    let join = |field: &str| match path {
        "" => field.to_owned(),
        p => format!("{p}.{field}"),
    };
    if let Some(field) = quoted_after(message, "missing field `") {
        let param = join(field);
        return ApiError::invalid(format!("`{param}` is required"), param);
    }
    let param = if path.is_empty() { "body" } else { path };
    if let Some((got, expected)) = message
        .strip_prefix("invalid type: ")
        .and_then(|m| m.split_once(", expected "))
    {
        return ApiError::invalid(
            format!("`{param}` must be {}, got {}", plain(expected), plain(got)),
            param,
        );
    }
    if let Some((got, expected)) = message
        .strip_prefix("unknown variant ")
        .and_then(|m| m.split_once(", expected "))
    {
        return ApiError::invalid(format!("`{param}` must be {expected}, got {got}"), param);
    }
    if let Some((_, expected)) = message
        .strip_prefix("unknown field ")
        .and_then(|m| m.split_once(", expected "))
    {
        return ApiError::invalid(
            format!("`{param}` is not supported (expected {expected})"),
            param,
        );
    }
    ApiError::invalid(format!("`{param}`: {message}"), param)
}

fn quoted_after<'a>(message: &'a str, prefix: &str) -> Option<&'a str> {
    message.strip_prefix(prefix)?.split('`').next()
}

/// serde's and Rust's names of JSON kinds, as a client would say them.
fn plain(kind: &str) -> &str {
    let word = kind.split([' ', '`']).next().unwrap_or(kind);
    match word {
        "f32" | "f64" | "floating" => "a number",
        "i8" | "i16" | "i32" | "i64" | "u8" | "u16" | "u32" | "u64" | "usize" | "integer" => {
            "an integer"
        }
        "string" => "a string",
        "boolean" | "bool" => "a boolean",
        "sequence" => "an array",
        "map" | "struct" => "an object",
        "unit" | "null" => "null",
        _ if kind == "a sequence" => "an array",
        _ if kind == "a map" => "an object",
        _ => kind,
    }
}

pub fn type_name(v: &Value) -> &'static str {
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

/// Integers, where `2.0` counts as 2 but `1.5` is no token count.
pub fn as_int(v: &Value) -> Option<i64> {
    let n = v.as_number()?;
    n.as_i64().or_else(|| {
        n.as_f64()
            .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
            .map(|f| f as i64)
    })
}

/// An optional integer field read by [`as_int`]'s rule.
pub fn whole<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    use serde::de::{Deserialize, Error, Unexpected};
    let value = Option::<Value>::deserialize(d)?;
    let Some(v) = value.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    as_int(&v).map(Some).ok_or_else(|| {
        let got = match &v {
            Value::Bool(b) => Unexpected::Bool(*b),
            Value::String(s) => Unexpected::Str(s),
            Value::Array(_) => Unexpected::Seq,
            Value::Object(_) => Unexpected::Map,
            _ => Unexpected::Float(v.as_f64().unwrap_or(f64::NAN)),
        };
        D::Error::invalid_type(got, &"an integer")
    })
}

/// A field that is a string or else an array or an object. serde's
/// untagged enums would lose the failing element's path; this reads the
/// JSON kind and hands the rest on, so `content[1].type` is still named.
pub enum StringOr<T> {
    String(String),
    Other(T),
}

impl<'de, T: serde::Deserialize<'de>> StringOr<T> {
    pub fn read<D: serde::Deserializer<'de>>(
        d: D,
        expecting: &'static str,
    ) -> Result<Self, D::Error> {
        d.deserialize_any(StringOrVisitor {
            expecting,
            marker: std::marker::PhantomData,
        })
    }
}

struct StringOrVisitor<T> {
    expecting: &'static str,
    marker: std::marker::PhantomData<T>,
}

impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for StringOrVisitor<T> {
    type Value = StringOr<T>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Self::Value, E> {
        Ok(StringOr::String(s.to_owned()))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        T::deserialize(serde::de::value::SeqAccessDeserializer::new(seq)).map(StringOr::Other)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(StringOr::Other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn object_rejects_everything_else() {
        for raw in ["", "  ", "{", "[1]", "3", "\"x\""] {
            let e = object(raw.as_bytes()).err().unwrap();
            assert_eq!(e.status().as_u16(), 400, "{raw}");
            assert_eq!(e.param(), None);
        }
    }

    #[test]
    fn failures_name_the_path_in_plain_words() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Inner {
            name: String,
        }
        #[derive(Debug, serde::Deserialize)]
        #[serde(rename_all = "lowercase")]
        enum Kind {
            Red,
            Green,
            Blue,
        }
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Outer {
            items: Vec<Inner>,
            kind: Option<Kind>,
            #[serde(default, deserialize_with = "whole")]
            count: Option<i64>,
        }
        let e = read::<Outer>(&json!({"items": [{"name": "a"}, {"name": 3}]})).unwrap_err();
        assert_eq!(e.param(), Some("items[1].name"));
        assert_eq!(
            e.to_string(),
            "`items[1].name` must be a string, got an integer"
        );
        let e = read::<Outer>(&json!({"items": [{}]})).unwrap_err();
        assert_eq!(e.param(), Some("items[0].name"));
        assert_eq!(e.to_string(), "`items[0].name` is required");
        let e = read::<Outer>(&json!({})).unwrap_err();
        assert_eq!(e.param(), Some("items"));
        let e = read::<Outer>(&json!({"items": [], "count": 1.5})).unwrap_err();
        assert_eq!(e.param(), Some("count"));
        assert_eq!(e.to_string(), "`count` must be an integer, got a number");
        let e = read::<Outer>(&json!({"items": [], "kind": "pink"})).unwrap_err();
        assert_eq!(
            e.to_string(),
            "`kind` must be one of `red`, `green`, `blue`, got `pink`"
        );
        let ok = read::<Outer>(&json!({"items": [], "count": 2.0, "other": null})).unwrap();
        assert_eq!(ok.count, Some(2));
    }
}
