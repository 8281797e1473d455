//! The official `openai` Python client against the gateway: chat, streaming
//! and a tool-call round trip with a `role: tool` message.

use std::process::Command;

use e2e_tests::build::workspace_root;
use e2e_tests::{basic_config, Gateway, MODEL};

const SCRIPT: &str = r#"
import json, sys
import openai

base, model, engines = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
client = openai.OpenAI(base_url=base, api_key="sk-test", max_retries=0)

# Chat, not streamed.
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)
assert r.object == "chat.completion", r
assert r.choices[0].message.role == "assistant"
assert isinstance(r.choices[0].message.content, str)
assert r.choices[0].finish_reason in ("stop", "length")
assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
assert r.usage.prompt_tokens_details.cached_tokens is not None
raw = client.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
assert raw.headers.get("x-engine") in engines, raw.headers
assert raw.headers.get("x-route-rule"), raw.headers

# Streamed, with usage.
chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
    max_tokens=8, stream=True, stream_options={"include_usage": True}))
assert chunks[0].choices[0].delta.role == "assistant"
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert text == r.choices[0].message.content, (text, r.choices[0].message.content)
finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
assert finishes == [r.choices[0].finish_reason], finishes
assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens

# Tool round trip: the assistant's call and the tool's answer go back in.
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
messages = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_abc", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": json.dumps({"temp_c": 24, "sky": "clear"})},
]
t = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="auto", max_tokens=6)
assert t.choices[0].message.role == "assistant"
assert t.usage.prompt_tokens > r.usage.prompt_tokens + 40, (t.usage, r.usage)
ts = list(client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=4, stream=True))
assert ts[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")

# Completions and models.
c = client.completions.create(model=model, prompt="The answer is", max_tokens=4)
assert c.object == "text_completion" and isinstance(c.choices[0].text, str)
assert [m.id for m in client.models.list().data] == [model]

# Errors surface as the client's typed exceptions.
try:
    client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    raise SystemExit("expected NotFoundError")
except openai.NotFoundError as e:
    assert e.body["code"] == "model_not_found", e.body
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=7)
    raise SystemExit("expected BadRequestError")
except openai.BadRequestError as e:
    assert e.body["param"] == "temperature", e.body
print("openai client ok")
"#;

fn run_client(gw: &Gateway, engines: &str) {
    let out = Command::new(fixtures::reference::python())
        .arg("-c")
        .arg(SCRIPT)
        .arg(format!("http://{}/v1", gw.addr))
        .arg(MODEL)
        .arg(engines)
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python failed:\n{stdout}\n{stderr}\ngateway log:\n{}",
        gw.logs()
    );
    assert!(stdout.contains("openai client ok"));
}

#[test]
fn official_openai_python_client_with_the_reference_engine() {
    run_client(&Gateway::start(&basic_config("")), "ref");
}

#[test]
fn official_openai_python_client_with_the_default_config() {
    let text = std::fs::read_to_string(workspace_root().join("config.yaml")).expect("config.yaml");
    let gw = Gateway::start(&text.replace("path: models/tiny-qwen3", "path: \"{model}\""));
    run_client(&gw, "batched,fastpath");
}
