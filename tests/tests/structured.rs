//! Structured outputs and the Responses API through the official `openai`
//! Python client, on a model with random weights (which follows no
//! instruction, so only the grammar makes its output valid): every sampled
//! or greedy output validates against its schema (Python `jsonschema`) on
//! each engine that applies grammars (batched sampled and greedy, the fast
//! path, prompt-lookup speculation verifying its drafts under the mask),
//! greedy output is the same text on each, forced tool calls carry valid
//! arguments, so do the calls a model starts under `tool_choice: "auto"`, a
//! tool schema the grammar compiler refuses is a 400 naming the tool and
//! the subschema, and
//! `/v1/responses` answers plain and streamed with the documented events.

use std::process::Command;

use e2e_tests::{Gateway, MODEL};

/// `max_tokens` picks the engine: 200 batched (the default), 201 the fast
/// path, 202 prompt-lookup speculation.
const CONFIG: &str = r#"model: { path: "{model}", kv_cache_mb: 64 }
engines:
  batched: { kind: batched }
  fastpath: { kind: fastpath }
  lookup: { kind: mtp, draft: ngram }
policy:
  default: batched
  fallback: [batched]
  rules:
    - { name: to-fastpath, when: { max_tokens: 201 }, route: fastpath }
    - { name: to-lookup, when: { max_tokens: 202 }, route: lookup }
"#;

const SCRIPT: &str = r#"
import json, sys
import jsonschema, openai

base, model, open_tag = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base, api_key="sk-test", max_retries=0)
user = [{"role": "user", "content": "Describe a person."}]
person = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}

def chat(engine_tokens, **kw):
    raw = client.chat.completions.with_raw_response.create(model=model, messages=user, max_tokens=engine_tokens, **kw)
    return raw.headers.get("x-engine"), raw.parse()

def valid(text, schema):
    v = json.loads(text)
    jsonschema.validate(v, schema)
    return v

# Many sampled outputs (batched engine, per-row masks in a shared batch).
for seed in range(16):
    engine, r = chat(200, response_format=fmt, temperature=1.0, seed=seed)
    assert engine == "batched", engine
    assert r.choices[0].finish_reason == "stop", r
    valid(r.choices[0].message.content, person)

# Greedy on each engine: batched, the fast path, and speculation.
greedy = {}
for tokens, expect in [(200, "batched"), (201, "fastpath"), (202, "lookup")]:
    engine, r = chat(tokens, response_format=fmt, temperature=0)
    assert engine == expect, (tokens, engine)
    assert r.choices[0].finish_reason == "stop", r
    greedy[tokens] = valid(r.choices[0].message.content, person)
assert greedy[200] == greedy[201] == greedy[202], greedy

# Speculation under the mask: prompt lookup drafts from a JSON example in
# the prompt; drafts the grammar forces are accepted, the others rejected,
# and the text equals the fast path's.
example = [{"role": "user", "content": 'Like {"name": "Ann", "age": 30, "tags": ["a", "b"], "ok": true} please.'}]
texts = {}
for tokens, expect in [(201, "fastpath"), (202, "lookup")]:
    raw = client.chat.completions.with_raw_response.create(model=model, messages=example, max_tokens=tokens, response_format=fmt, temperature=0)
    r = raw.parse()
    assert raw.headers.get("x-engine") == expect, raw.headers
    assert r.choices[0].finish_reason == "stop", r
    texts[expect] = r.choices[0].message.content
    valid(texts[expect], person)
spec = r.usage.model_extra["speculative"]
assert 0 < spec["accepted_tokens"] < spec["drafted_tokens"], spec
assert texts["fastpath"] == texts["lookup"], texts

# Not strict, json_object, vLLM's extensions; streamed too.
# (A schema that leaves strings or extra properties unbounded may be cut
# off by max_tokens on random weights: the schemas here bound the output.)
loose = {"type": "json_schema", "json_schema": {"name": "p", "schema": person, "strict": False}}
for tokens in (200, 201, 202):
    _, r = chat(tokens, response_format=loose, temperature=0)
    valid(r.choices[0].message.content, person)
    _, r = chat(tokens, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(json.loads(r.choices[0].message.content), dict), r
    _, r = chat(tokens, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].message.content in ("yes", "no", "maybe"), r
    _, r = chat(tokens, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    c = r.choices[0].message.content
    assert len(c) == 6 and c[:3].isdigit() and c[3] == "-" and c[4:].isalpha(), c
    _, r = chat(tokens, extra_body={"structured_outputs": {"json": person}})
    valid(r.choices[0].message.content, person)
    _, r = chat(tokens, extra_body={"guided_json": person})
    valid(r.choices[0].message.content, person)
    chunks = list(client.chat.completions.create(model=model, messages=user, max_tokens=tokens, response_format=fmt, stream=True))
    valid("".join(c.choices[0].delta.content or "" for c in chunks if c.choices), person)
    assert chunks[-1].choices[0].finish_reason == "stop"
c = client.completions.create(model=model, prompt="Numbers:", max_tokens=200, extra_body={"guided_regex": "[0-9]{4}"})
assert len(c.choices[0].text) == 4 and c.choices[0].text.isdigit(), c

# Forced tool calls: the family's format, arguments valid against the parameters.
weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
tools = [
    {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]
for seed in range(4):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        # Random weights would chain parallel calls up to max_tokens.
        r = client.chat.completions.create(model=model, messages=user, max_tokens=600, tools=tools, tool_choice=choice,
            parallel_tool_calls=False, temperature=1.0, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls, r
        for call in calls:
            args = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                jsonschema.validate(args, weather)
            else:
                assert choice == "required" and call.function.name == "ping" and args == {}, call
        assert len(calls) == 1, calls
        if choice != "required":
            assert calls[0].function.name == "get_weather", calls

# `tool_choice: "auto"`: text, or a call held to the schema from the moment
# it starts. Random weights never start one on their own: a bias on the
# open tag's token makes them.
for seed in range(4):
    for bias in ({}, {open_tag: 100}):
        r = client.chat.completions.create(model=model, messages=user, max_tokens=120, tools=tools[:1],
            parallel_tool_calls=False, temperature=1.0, seed=seed, logit_bias=bias)
        calls = r.choices[0].message.tool_calls or []
        assert len(calls) == (1 if bias else 0), r
        for call in calls:
            assert call.function.name == "get_weather", call
            jsonschema.validate(json.loads(call.function.arguments), weather)
            assert r.choices[0].finish_reason == "tool_calls", r

# A tool schema llguidance cannot compile: the client's 400, naming the tool
# and where in its schema.
zip_tool = {"type": "function", "function": {"name": "mail", "parameters": {"type": "object",
    "properties": {"to": {"type": "object", "properties": {"zip": {"type": "string", "format": "zip-code"}}}}}}}
for choice in ("auto", "required"):
    try:
        client.chat.completions.create(model=model, messages=user, max_tokens=8, tools=[tools[1], zip_tool], tool_choice=choice)
        raise SystemExit("expected a 400 for the zip-code format")
    except openai.BadRequestError as e:
        assert e.body["param"] == "tools[1].function.parameters", e.body
        assert "`mail`" in e.body["message"] and "/properties/to/properties/zip" in e.body["message"], e.body
try:
    client.responses.create(model=model, input="x", max_output_tokens=8, tools=[{"type": "function", "name": "mail",
        "parameters": zip_tool["function"]["parameters"], "strict": True}])
    raise SystemExit("expected a 400 for the zip-code format")
except openai.BadRequestError as e:
    assert e.body["param"] == "tools[0].parameters", e.body

# Bad constraints are the client's 400, naming the field.
for kw, param in [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}), "response_format.json_schema.schema"),
    (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
    (dict(extra_body={"guided_grammar": "start: nowhere"}), "guided_grammar"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_choice": ["a"]}), "guided_choice"),
]:
    try:
        client.chat.completions.create(model=model, messages=user, max_tokens=8, **kw)
        raise SystemExit(f"expected a 400 for {param}")
    except openai.BadRequestError as e:
        assert e.body["param"] == param, (param, e.body)

# The Responses API.
r = client.responses.create(model=model, input="Hello!", instructions="Be brief.", max_output_tokens=8)
assert r.object == "response" and r.status in ("completed", "incomplete"), r
assert isinstance(r.output_text, str)
assert r.usage.output_tokens <= 8 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage
if r.status == "incomplete":
    assert r.incomplete_details.reason == "max_output_tokens"
r = client.responses.create(model=model, input=[{"role": "user", "content": [{"type": "input_text", "text": "A person?"}]}],
    max_output_tokens=200, text={"format": {"type": "json_schema", "name": "person", "schema": person, "strict": True}})
assert r.status == "completed", r
valid(r.output_text, person)
events = list(client.responses.create(model=model, input="Hi", max_output_tokens=200, stream=True,
    text={"format": {"type": "json_schema", "name": "person", "schema": person}}))
kinds = [e.type for e in events]
assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"], kinds
assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed", kinds
assert [e.sequence_number for e in events] == list(range(len(events)))
streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
valid(streamed, person)
assert events[-1].response.output_text == streamed
resp_tools = [{"type": "function", "name": "get_weather", "parameters": weather, "strict": True}]
r = client.responses.create(model=model, input="Weather in Paris?", tools=resp_tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=600)
calls = [o for o in r.output if o.type == "function_call"]
assert calls and calls[0].name == "get_weather", r.output
jsonschema.validate(json.loads(calls[0].arguments), weather)
r2 = client.responses.create(model=model, tools=resp_tools, max_output_tokens=4, input=[
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
    {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
])
assert r2.usage.input_tokens > r.usage.input_tokens, (r2.usage, r.usage)
events = list(client.responses.create(model=model, input="Weather?", tools=resp_tools, tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=600, stream=True))
kinds = [e.type for e in events]
assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed", kinds
try:
    client.responses.create(model=model, input="x", previous_response_id="resp_123")
    raise SystemExit("expected a 400 for previous_response_id")
except openai.BadRequestError as e:
    assert e.body["param"] == "previous_response_id", e.body
print("structured ok")
"#;

#[test]
fn structured_outputs_and_responses_through_the_openai_client() {
    let gw = Gateway::start(CONFIG);
    let tokenizer = text::Tokenizer::from_dir(e2e_tests::models::tiny_qwen3()).unwrap();
    let open_tag = tokenizer
        .hf()
        .token_to_id("<tool_call>")
        .expect("Qwen's tag is one token");
    let out = Command::new(fixtures::reference::python())
        .arg("-c")
        .arg(SCRIPT)
        .arg(format!("http://{}/v1", gw.addr))
        .arg(MODEL)
        .arg(open_tag.to_string())
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("structured ok"),
        "python failed:\n{stdout}\n{stderr}\ngateway log:\n{}",
        gw.logs()
    );
}

/// A request that thinks writes its reasoning free of the grammar: on a
/// model whose chat template opens the think block, the reasoning under
/// a JSON Schema is the unconstrained run's (cut by `thinking_budget`,
/// which closes the block), and the answer after it validates, the same
/// text on every engine (each the policy's default: the budget's legs are
/// routed apart).
const THINKING_SCRIPT: &str = r#"
import json, sys
import jsonschema, openai

base, model, engine = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base, api_key="sk-test", max_retries=0)
user = [{"role": "user", "content": "Think first, then describe a person."}]
person = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}

def chat(**kw):
    raw = client.chat.completions.with_raw_response.create(model=model, messages=user, max_tokens=200,
        temperature=0, extra_body={"thinking_budget": 6, "ignore_eos": True}, **kw)
    return raw.headers.get("x-engine"), raw.parse()

def tokens_of(r):
    return [t.token for t in r.choices[0].logprobs.content]

if engine == "batched":
    # The reasoning's tokens (random weights: mostly special tokens, no
    # text), free and under the schema (logprobs need the batched engine).
    _, free = chat(logprobs=True)
    _, held = chat(logprobs=True, response_format=fmt)
    assert tokens_of(held)[:6] == tokens_of(free)[:6], (tokens_of(held), tokens_of(free))
    assert tokens_of(held)[6:8] == ["\n", "</think>"], tokens_of(held)
served, r = chat(response_format=fmt)
assert served == engine, (served, engine)
c = r.choices[0]
assert c.finish_reason == "stop", c
assert r.usage.completion_tokens_details.reasoning_tokens == 8, r.usage
jsonschema.validate(json.loads(c.message.content), person)
print("answer:", c.message.content)
"#;

#[test]
fn reasoning_is_exempt_from_the_grammar() {
    let model = e2e_tests::models::tiny_qwen3_thinking();
    let mut answers = Vec::new();
    for engine in ["batched", "fastpath", "lookup"] {
        let config = format!(
            r#"model: {{ path: "{}", kv_cache_mb: 64 }}
engines:
  batched: {{ kind: batched }}
  fastpath: {{ kind: fastpath }}
  lookup: {{ kind: mtp, draft: ngram }}
policy: {{ default: {engine} }}
"#,
            model.display()
        );
        let gw = Gateway::start(&config);
        let out = Command::new(fixtures::reference::python())
            .arg("-c")
            .arg(THINKING_SCRIPT)
            .arg(format!("http://{}/v1", gw.addr))
            .arg(MODEL)
            .arg(engine)
            .output()
            .expect("run python");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let answer = stdout.lines().find_map(|l| l.strip_prefix("answer: "));
        assert!(
            out.status.success() && answer.is_some(),
            "{engine}: python failed:\n{stdout}\n{stderr}\ngateway log:\n{}",
            gw.logs()
        );
        answers.push(answer.unwrap().to_owned());
    }
    assert!(answers.windows(2).all(|w| w[0] == w[1]), "{answers:?}");
}
