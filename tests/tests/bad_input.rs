//! The bad-input table: every malformed or out-of-range request gets the
//! exact OpenAI-style error (status, `error.type`, `error.param`,
//! `error.code`), and the gateway stays healthy afterwards.

use e2e_tests::http::{self, Response};
use e2e_tests::{basic_config, Gateway, MODEL};
use serde_json::{json, Value};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const RESPONSES: &str = "/v1/responses";
const BODY_LIMIT: usize = 256 * 1024;

/// One row: what is sent, and the error expected back.
struct Case {
    name: &'static str,
    path: &'static str,
    body: Vec<u8>,
    status: u16,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

fn case(name: &'static str, path: &'static str, body: Value, status: u16) -> Case {
    Case {
        name,
        path,
        body: body.to_string().into_bytes(),
        status,
        kind: "invalid_request_error",
        param: None,
        code: None,
    }
}

fn raw(name: &'static str, path: &'static str, body: &[u8]) -> Case {
    Case {
        body: body.to_vec(),
        ..case(name, path, Value::Null, 400)
    }
}

impl Case {
    fn param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn tool(parameters: Value) -> Value {
    json!([{"type": "function", "function": {"name": "f", "parameters": parameters}}])
}

fn table() -> Vec<Case> {
    let over_window: Vec<u32> = (0..33_000).map(|i| 3 + i % 200).collect();
    vec![
        // Not a JSON object at all.
        raw("invalid JSON", CHAT, b"{not json"),
        raw("empty body", CHAT, b""),
        raw("JSON but not an object", CHAT, b"[1, 2]"),
        raw(
            "invalid UTF-8",
            CHAT,
            b"{\"model\": \"tiny-qwen3\", \"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}",
        ),
        // Wrong types.
        case("messages not a list", CHAT, json!({"model": MODEL, "messages": "hi"}), 400)
            .param("messages"),
        // Images (the vision model's own table is in tests/vision.rs).
        case(
            "image to a text-only model",
            CHAT,
            json!({"model": MODEL, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}),
            400,
        )
        .param("messages[0].content[0].image_url.url")
        .code("images_not_supported"),
        case(
            "image part without a url",
            CHAT,
            json!({"model": MODEL, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {}}]}]}),
            400,
        )
        .param("messages[0].content[0].image_url.url"),
        case(
            "image in an assistant message",
            CHAT,
            json!({"model": MODEL, "messages": [{"role": "assistant", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
            400,
        )
        .param("messages[0].content"),
        case("temperature as a string", CHAT, chat(json!({"temperature": "hot"})), 400)
            .param("temperature"),
        case("max_tokens as a string", CHAT, chat(json!({"max_tokens": "5"})), 400)
            .param("max_tokens"),
        case("stop as a number", CHAT, chat(json!({"stop": 5})), 400).param("stop"),
        case("logit_bias with a non-id key", CHAT, chat(json!({"logit_bias": {"x": 1}})), 400)
            .param("logit_bias"),
        case("prompt as a number", COMPLETIONS, json!({"model": MODEL, "prompt": 5}), 400)
            .param("prompt"),
        case("missing model", CHAT, json!({"messages": [{"role": "user", "content": "hi"}]}), 400)
            .param("model"),
        // Messages.
        case("empty messages", CHAT, json!({"model": MODEL, "messages": []}), 400)
            .param("messages"),
        case(
            "unknown role",
            CHAT,
            json!({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
            400,
        )
        .param("messages[0].role"),
        case(
            "message without content",
            CHAT,
            json!({"model": MODEL, "messages": [{"role": "user"}]}),
            400,
        )
        .param("messages[0].content"),
        // Lengths.
        case(
            "prompt over the context window",
            COMPLETIONS,
            json!({"model": MODEL, "prompt": over_window, "max_tokens": 1}),
            400,
        )
        .param("prompt")
        .code("context_length_exceeded"),
        case("max_tokens over the window", CHAT, chat(json!({"max_tokens": 10_000_000})), 400)
            .param("max_tokens")
            .code("context_length_exceeded"),
        case("max_tokens negative", CHAT, chat(json!({"max_tokens": -5})), 400)
            .param("max_tokens"),
        case("max_tokens zero", CHAT, chat(json!({"max_tokens": 0})), 400).param("max_tokens"),
        case(
            "max_completion_tokens negative",
            CHAT,
            chat(json!({"max_completion_tokens": -1})),
            400,
        )
        .param("max_completion_tokens"),
        // Ranges.
        case("temperature above 2", CHAT, chat(json!({"temperature": 9})), 400)
            .param("temperature"),
        case("temperature negative", CHAT, chat(json!({"temperature": -0.5})), 400)
            .param("temperature"),
        case("top_p zero", CHAT, chat(json!({"top_p": 0})), 400).param("top_p"),
        case("top_p above 1", CHAT, chat(json!({"top_p": 1.5})), 400).param("top_p"),
        case("n zero", CHAT, chat(json!({"n": 0})), 400).param("n"),
        case("n above server.max_n", CHAT, chat(json!({"n": 9})), 400).param("n"),
        case("best_of", CHAT, chat(json!({"best_of": 2})), 400).param("best_of"),
        case(
            "best_of on completions",
            COMPLETIONS,
            json!({"model": MODEL, "prompt": "x", "best_of": 3}),
            400,
        )
        .param("best_of"),
        case(
            "prompts x n above server.max_n",
            COMPLETIONS,
            json!({"model": MODEL, "prompt": ["a", "b", "c"], "n": 3}),
            400,
        )
        .param("prompt"),
        case(
            "an empty prompt in a list",
            COMPLETIONS,
            json!({"model": MODEL, "prompt": ["a", ""]}),
            400,
        )
        .param("prompt[1]"),
        case(
            "a prompt list of mixed kinds",
            COMPLETIONS,
            json!({"model": MODEL, "prompt": ["a", 7]}),
            400,
        )
        .param("prompt[1]"),
        case(
            "top_logprobs above 20",
            CHAT,
            chat(json!({"logprobs": true, "top_logprobs": 50})),
            400,
        )
        .param("top_logprobs"),
        case(
            "stop list too long",
            CHAT,
            chat(json!({"stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]})),
            400,
        )
        .param("stop"),
        // Tools.
        case("tool without function", CHAT, chat(json!({"tools": [{"type": "function"}]})), 400)
            .param("tools[0].function"),
        case(
            "tool parameters not an object",
            CHAT,
            chat(json!({"tools": tool(json!("object"))})),
            400,
        )
        .param("tools[0].function.parameters"),
        case(
            "tool parameters not a JSON Schema",
            CHAT,
            chat(json!({"tools": tool(json!({"type": "banana"}))})),
            400,
        )
        .param("tools[0].function.parameters"),
        case(
            "tool schema with malformed properties",
            CHAT,
            chat(json!({"tools": tool(json!({"type": "object", "properties": 5}))})),
            400,
        )
        .param("tools[0].function.parameters"),
        case(
            "tool_choice naming an unknown tool",
            CHAT,
            chat(json!({"tools": tool(json!({"type": "object"})), "tool_choice": {"type": "function", "function": {"name": "g"}}})),
            400,
        )
        .param("tool_choice"),
        // Structured outputs.
        case(
            "json_schema without a schema",
            CHAT,
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})),
            400,
        )
        .param("response_format.json_schema.schema"),
        case(
            "json_schema not a JSON Schema",
            CHAT,
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}})),
            400,
        )
        .param("response_format.json_schema.schema"),
        case(
            "response_format of an unknown type",
            CHAT,
            chat(json!({"response_format": {"type": "yaml"}})),
            400,
        )
        .param("response_format.type"),
        case(
            "regex that does not compile",
            COMPLETIONS,
            json!({"model": MODEL, "prompt": "x", "guided_regex": "(unclosed"}),
            400,
        )
        .param("guided_regex"),
        case(
            "grammar that does not compile",
            CHAT,
            chat(json!({"guided_grammar": "start: nowhere"})),
            400,
        )
        .param("guided_grammar"),
        case(
            "schema the grammar compiler cannot use",
            CHAT,
            chat(json!({"structured_outputs": {"json": {"type": "string", "pattern": "(?<=a)b"}}})),
            400,
        )
        .param("structured_outputs.json"),
        case("empty choice list", CHAT, chat(json!({"guided_choice": []})), 400)
            .param("guided_choice"),
        case(
            "two constraints",
            CHAT,
            chat(json!({"response_format": {"type": "json_object"}, "guided_choice": ["a"]})),
            400,
        )
        .param("guided_choice"),
        case(
            "a forced tool call with a constraint",
            CHAT,
            chat(json!({"tools": tool(json!({"type": "object"})), "tool_choice": "required", "guided_regex": "a"})),
            400,
        )
        .param("tool_choice"),
        // The Responses API.
        case("responses without input", RESPONSES, json!({"model": MODEL}), 400).param("input"),
        case(
            "responses with previous_response_id",
            RESPONSES,
            json!({"model": MODEL, "input": "hi", "previous_response_id": "resp_1"}),
            400,
        )
        .param("previous_response_id"),
        case(
            "responses with a built-in tool",
            RESPONSES,
            json!({"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}),
            400,
        )
        .param("tools[0].type"),
        case(
            "responses with max_output_tokens zero",
            RESPONSES,
            json!({"model": MODEL, "input": "hi", "max_output_tokens": 0}),
            400,
        )
        .param("max_output_tokens"),
        case(
            "responses text.format without a schema",
            RESPONSES,
            json!({"model": MODEL, "input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}),
            400,
        )
        .param("text.format.schema"),
        // Size and model.
        Case {
            body: chat(json!({"messages": [{"role": "user", "content": "x".repeat(BODY_LIMIT)}]}))
                .to_string()
                .into_bytes(),
            ..case("oversize body", CHAT, Value::Null, 413)
        },
        case("unknown model", CHAT, chat(json!({"model": "gpt-nope"})), 404)
            .param("model")
            .code("model_not_found"),
        case("unknown route", "/v1/nothing-here", json!({}), 404),
    ]
}

fn check(case: &Case, r: &Response) {
    let name = case.name;
    assert_eq!(r.status, case.status, "{name}: {}", r.text());
    let v = r.json();
    let error = &v["error"];
    assert_eq!(error["type"], case.kind, "{name}: {v}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(!message.is_empty(), "{name}: no message in {v}");
    if let Some(param) = case.param {
        assert_eq!(error["param"], param, "{name}: {v}");
    }
    if let Some(code) = case.code {
        assert_eq!(error["code"], code, "{name}: {v}");
    }
}

#[test]
fn every_bad_input_gets_its_exact_error() {
    let gw = Gateway::start(&basic_config(&format!("  body_limit_bytes: {BODY_LIMIT}")));
    for case in table() {
        let r = http::request(gw.addr, "POST", case.path, &[], &case.body);
        check(&case, &r);
    }
    // Methods: GET on a POST route.
    let r = gw.get(CHAT);
    assert_eq!(r.status, 405, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");

    // Unknown fields are ignored, as OpenAI does.
    let r = gw.post(
        CHAT,
        &chat(json!({"max_tokens": 2, "frobnicate": {"a": 1}, "user": "u1"})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    // Nothing was leaked and the gateway is fine.
    let health = gw.health();
    assert_eq!(health["status"], "ok", "{health}");
    assert_eq!(health["kv_pool"]["allocated_blocks"], 0, "{health}");
}
