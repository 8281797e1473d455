//! JSON Schema walking: closing objects for strict decoding, and the
//! subschemas a compile error may sit in.

use serde_json::{Map, Value};

/// Keywords whose value is one subschema.
const ONE: &[&str] = &[
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
];
/// Keywords whose value is a list of subschemas.
const LIST: &[&str] = &["prefixItems", "anyOf", "oneOf", "allOf", "items"];
/// Keywords whose value maps names to subschemas.
/// Definitions first: a subschema that refers to a broken definition
/// fails too, and the definition is the place to name.
const NAMED: &[&str] = &[
    "$defs",
    "definitions",
    "properties",
    "patternProperties",
    "dependentSchemas",
];

/// The subschemas of `schema` with their JSON Pointer suffixes
/// (`/properties/city`).
pub(crate) fn children(schema: &Value) -> Vec<(String, &Value)> {
    let mut out = Vec::new();
    let Value::Object(obj) = schema else {
        return out;
    };
    for &key in NAMED {
        if let Some(Value::Object(named)) = obj.get(key) {
            out.extend(
                named
                    .iter()
                    .map(|(name, v)| (format!("/{key}/{}", pointer_escape(name)), v)),
            );
        }
    }
    for &key in ONE {
        if let Some(v @ (Value::Object(_) | Value::Bool(_))) = obj.get(key) {
            out.push((format!("/{key}"), v));
        }
    }
    for &key in LIST {
        if let Some(Value::Array(items)) = obj.get(key) {
            out.extend(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| (format!("/{key}/{i}"), v)),
            );
        }
    }
    out
}

fn pointer_escape(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

/// The schema as OpenAI's strict mode reads it: every object schema that
/// does not say otherwise admits no properties beyond its own
/// (`additionalProperties: false`). The members of an `allOf` stay open,
/// since their properties add up; a schema that only refers (`$ref`) is
/// closed where it is defined.
pub fn closed(schema: &Value) -> Value {
    let mut out = schema.clone();
    close(&mut out, false);
    out
}

fn close(schema: &mut Value, in_all_of: bool) {
    let Value::Object(obj) = schema else {
        return;
    };
    if !in_all_of && is_object_schema(obj) && !obj.contains_key("additionalProperties") {
        obj.insert("additionalProperties".into(), Value::Bool(false));
    }
    for &key in ONE {
        if let Some(v) = obj.get_mut(key) {
            close(v, false);
        }
    }
    for &key in LIST {
        if let Some(Value::Array(items)) = obj.get_mut(key) {
            items.iter_mut().for_each(|v| close(v, key == "allOf"));
        }
    }
    for &key in NAMED {
        if let Some(Value::Object(named)) = obj.get_mut(key) {
            named.values_mut().for_each(|v| close(v, false));
        }
    }
}

fn is_object_schema(obj: &Map<String, Value>) -> bool {
    let typed_object = match obj.get("type") {
        Some(Value::String(t)) => t == "object",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "object"),
        _ => false,
    };
    (typed_object || obj.contains_key("properties"))
        && !obj.contains_key("unevaluatedProperties")
        && !obj.contains_key("$ref")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_close_unless_they_say_otherwise() {
        let schema = json!({
            "type": "object",
            "properties": {
                "home": {"$ref": "#/$defs/Place"},
                "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
                "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
                "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
            },
            "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}}}
        });
        let c = closed(&schema);
        assert_eq!(c["additionalProperties"], false);
        assert_eq!(c["$defs"]["Place"]["additionalProperties"], false);
        assert_eq!(
            c["properties"]["tags"]["items"]["additionalProperties"],
            false
        );
        assert_eq!(
            c["properties"]["extra"]["additionalProperties"],
            json!({"type": "integer"})
        );
        assert!(c["properties"]["home"]
            .get("additionalProperties")
            .is_none());
        assert!(c["properties"]["both"]["allOf"][0]
            .get("additionalProperties")
            .is_none());
    }

    #[test]
    fn children_name_their_pointer() {
        let schema = json!({"properties": {"a/b": {"type": "string"}}, "anyOf": [true, {}]});
        let paths: Vec<String> = children(&schema).into_iter().map(|(p, _)| p).collect();
        assert_eq!(paths, ["/properties/a~1b", "/anyOf/0", "/anyOf/1"]);
    }
}
