//! The official `openai` Python client against the gateway: chat, streaming,
//! a tool-call round trip with a `role: tool` message, several choices
//! (`n`, streamed interleaved by index) and completions' prompt lists.

use std::process::Command;

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

# Several choices (n), streamed interleaved by index, and prompt lists.
g = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
    max_tokens=8, n=2, temperature=0)
assert [ch.index for ch in g.choices] == [0, 1], g
assert all(ch.message.content == r.choices[0].message.content for ch in g.choices), (g, r)
assert g.usage.prompt_tokens == r.usage.prompt_tokens, (g.usage, r.usage)
assert g.usage.completion_tokens == 2 * r.usage.completion_tokens, (g.usage, r.usage)
def by_index(chunks, text_of):
    texts, finishes = {}, {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (text_of(ch) or "")
            if ch.finish_reason:
                assert ch.index not in finishes, ("two finishes", ch.index)
                finishes[ch.index] = ch.finish_reason
    return texts, finishes
gs = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
    max_tokens=8, n=2, temperature=0, stream=True, stream_options={"include_usage": True}))
texts, finishes = by_index(gs, lambda ch: ch.delta.content)
assert texts == {0: r.choices[0].message.content, 1: r.choices[0].message.content}, texts
assert sorted(finishes) == [0, 1], finishes
assert gs[-1].usage.completion_tokens == g.usage.completion_tokens, gs[-1].usage
sampled = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
    max_tokens=4, n=3, temperature=1.0, seed=5)
assert [ch.index for ch in sampled.choices] == [0, 1, 2], sampled
assert all(ch.finish_reason in ("stop", "length") for ch in sampled.choices)
one = client.completions.create(model=model, prompt="Once upon", max_tokens=4, temperature=0)
lst = client.completions.create(model=model, prompt=["The answer is", "Once upon"], max_tokens=4, n=2, temperature=0)
c0 = client.completions.create(model=model, prompt="The answer is", max_tokens=4, temperature=0)
assert [ch.index for ch in lst.choices] == [0, 1, 2, 3], lst
assert [ch.text for ch in lst.choices] == [c0.choices[0].text] * 2 + [one.choices[0].text] * 2, lst
assert lst.usage.prompt_tokens == c0.usage.prompt_tokens + one.usage.prompt_tokens, lst.usage
ls = list(client.completions.create(model=model, prompt=[[1, 2, 3], [4, 5]], max_tokens=3, temperature=0, stream=True))
texts, finishes = by_index(ls, lambda ch: ch.text)
assert sorted(texts) == [0, 1] and sorted(finishes) == [0, 1], (texts, finishes)
ids = client.completions.create(model=model, prompt=[4, 5], max_tokens=3, temperature=0)
assert texts[1] == ids.choices[0].text, (texts, ids)
for bad, param in [(dict(n=99), "n"), (dict(best_of=2), "best_of")]:
    try:
        client.completions.create(model=model, prompt="x", max_tokens=2, **bad)
        raise SystemExit("expected BadRequestError for %s" % bad)
    except openai.BadRequestError as e:
        assert e.body["param"] == param, e.body
try:
    client.completions.create(model=model, prompt=["x"] * 5, n=2, max_tokens=2)
    raise SystemExit("expected BadRequestError for 10 choices")
except openai.BadRequestError as e:
    assert e.body["param"] == "prompt", e.body

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
    let gw = Gateway::start(&e2e_tests::default_config_on_tiny_model());
    run_client(&gw, "batched,fastpath,lookup");
}
