//! Client libraries as people use them, against the trained default model
//! (SmolLM2-135M-Instruct, config.yaml as shipped): the `openai` Python
//! SDK's `chat.completions.parse` with a pydantic model and with
//! `openai.pydantic_function_tool` (strict, forced), a forced call whose
//! schema came from pydantic without `additionalProperties` (what
//! structured-output libraries send in their tool-calling mode), a
//! Responses API function tool, and an agent loop (forced call, tool
//! result, answer). Each case parses what it gets with pydantic, the way
//! the library would; the script reports every case before failing.

use std::process::Command;

use e2e_tests::{Gateway, DEFAULT_MODEL_NAME, DEFAULT_MODEL_PATH};

const SCRIPT: &str = r#"
import json, sys
from typing import Literal
import openai, pydantic
from openai.lib._pydantic import to_strict_json_schema

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="sk-test", max_retries=0)

class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population: int = pydantic.Field(ge=0, le=100_000_000)

class GetWeather(pydantic.BaseModel):
    """Current weather for a city."""
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]

ask_city = [{"role": "user", "content": "Give the name, country and population of the capital of France."}]
ask_weather = [{"role": "user", "content": "What is the weather in Paris?"}]
results = {}

def case(name):
    def run(fn):
        try:
            results[name] = {"ok": True, "got": fn()}
        except Exception as e:
            results[name] = {"ok": False, "got": f"{type(e).__name__}: {e}"[:400]}
    return run

@case("parse_response_format")
def _():
    r = client.chat.completions.parse(model=model, messages=ask_city, response_format=City, max_tokens=120, temperature=0)
    city = r.choices[0].message.parsed
    assert isinstance(city, City), r
    return city.model_dump()

@case("parse_pydantic_function_tool")
def _():
    tool = openai.pydantic_function_tool(GetWeather)
    assert tool["function"]["strict"] is True
    r = client.chat.completions.parse(model=model, messages=ask_weather, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}}, max_tokens=120, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls, r
    assert isinstance(calls[0].function.parsed_arguments, GetWeather), calls
    return calls[0].function.parsed_arguments.model_dump()

@case("parse_pydantic_function_tool_auto")
def _():
    # The model writes a JSON call when asked to; whether it does is its
    # choice (`tool_choice: "auto"`), what it writes once it does is not.
    ask = [{"role": "user", "content": 'Reply with a JSON object {"name": "GetWeather", "parameters": {"city": ..., "unit": ...}} for the weather in Paris.'}]
    r = client.chat.completions.parse(model=model, messages=ask,
        tools=[openai.pydantic_function_tool(GetWeather)], max_tokens=200, temperature=0)
    message = r.choices[0].message
    if message.tool_calls:
        assert isinstance(message.tool_calls[0].function.parsed_arguments, GetWeather), message
        return {"call": message.tool_calls[0].function.parsed_arguments.model_dump()}
    assert isinstance(message.content, str), message
    return {"content": message.content[:80]}

@case("forced_call_plain_pydantic_schema")
def _():
    # No `strict`, no `additionalProperties`: pydantic's own JSON Schema.
    schema = City.model_json_schema()
    schema.pop("additionalProperties")
    tool = {"type": "function", "function": {"name": "City", "description": "A city", "parameters": schema}}
    r = client.chat.completions.create(model=model, messages=ask_city, tools=[tool], tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls and len(calls) == 1, r
    return City.model_validate_json(calls[0].function.arguments).model_dump()

@case("response_format_strict_open_schema")
def _():
    # `strict: true` on a schema that leaves `additionalProperties` unset.
    schema = City.model_json_schema()
    schema.pop("additionalProperties")
    r = client.chat.completions.create(model=model, messages=ask_city, max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "City", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop", r
    return City.model_validate_json(r.choices[0].message.content).model_dump()

@case("responses_function_tool")
def _():
    tool = {"type": "function", "name": "get_weather", "description": "Current weather for a city.",
        "parameters": to_strict_json_schema(GetWeather), "strict": True}
    r = client.responses.create(model=model, input="What is the weather in Paris?", tools=[tool],
        tool_choice="required", parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r
    return GetWeather.model_validate_json(calls[0].arguments).model_dump()

@case("agent_loop")
def _():
    tools = [openai.pydantic_function_tool(GetWeather, name="get_weather")]
    messages = list(ask_weather)
    first = client.chat.completions.create(model=model, messages=messages, tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    args = GetWeather.model_validate_json(call.function.arguments)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id,
        "content": json.dumps({"city": args.city, "temperature": 21, "unit": args.unit, "sky": "clear"})})
    answer = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=60, temperature=0)
    message = answer.choices[0].message
    for later in message.tool_calls or []:
        GetWeather.model_validate_json(later.function.arguments)
    assert message.content or message.tool_calls, answer
    return {"call": args.model_dump(), "answer": message.content, "calls": len(message.tool_calls or [])}

for name, result in results.items():
    print(name, json.dumps(result))
if all(r["ok"] for r in results.values()):
    print("clients ok")
"#;

#[test]
fn openai_sdk_structured_outputs_and_tools_on_the_default_model() {
    let root = e2e_tests::build::workspace_root();
    let text = std::fs::read_to_string(root.join("config.yaml")).expect("config.yaml");
    let model = fixtures::reference::default_gguf();
    let gw = Gateway::start(&text.replace(
        &format!("path: {DEFAULT_MODEL_PATH}"),
        &format!("path: \"{}\"", model.display()),
    ));
    let out = Command::new(fixtures::reference::python())
        .arg("-c")
        .arg(SCRIPT)
        .arg(format!("http://{}/v1", gw.addr))
        .arg(DEFAULT_MODEL_NAME)
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("clients ok"),
        "client cases failed:\n{stdout}\n{stderr}\ngateway log:\n{}",
        gw.logs()
    );
}
