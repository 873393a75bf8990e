"""The official openai SDK against a running Engram server, as agent frameworks call it: any
model name, any `user`, content-part arrays, tool calls (forced ones constrained to their
schema), structured output, log probabilities, seeds, stops (run by tests/e2e/openai.rs).

usage: openai_tools.py BASE_URL API_KEY
"""
import json
import sys

import jsonschema
import openai

base, key = sys.argv[1:3]
client = openai.OpenAI(base_url=f"{base}/v1", api_key=key)

# The served model is listed first; it (or any other name) selects the default agent.
models = [m.id for m in client.models.list().data]
assert models and models[0].endswith(".gguf"), models
served = models[0]
for name in (served, "gpt-4o-mini"):
    r = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].message.content, r
    assert r.model == "default", r.model
assert "default" in [m.id for m in client.models.list().data]

# Content-part arrays, what LangChain and the Agents SDK send.
parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
r = client.chat.completions.create(
    model="default",
    messages=[
        {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
        {"role": "user", "content": parts},
    ],
    max_tokens=8,
    temperature=0,
)
assert r.choices[0].message.content, r
try:
    client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
        max_tokens=4,
    )
    raise AssertionError("an image part was accepted")
except openai.BadRequestError as e:
    assert e.body.get("code") == "unsupported_content", e.body

# Any `user` string: an e-mail address names a session; its second turn reuses the first.
for turn, text in enumerate(["My name is Ada.", "What is my name?"]):
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": text}],
        user="ada@example.com",
        max_tokens=8,
        temperature=0,
    )
    if turn == 1:
        assert r.usage.prompt_tokens_details.cached_tokens > 0, r.usage

# Tools. A forced call is constrained to the function's schema: it parses and validates even
# on a 135M model.
weather = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
tools = [
    {"type": "function", "function": {
        "name": "forecast", "description": "The weather forecast of a city.",
        "parameters": weather}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two integers.",
        "parameters": {"type": "object",
                       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]
schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
ask = [{"role": "user", "content": "What will the weather be in Lyon for the next 3 days?"}]
for choice in ("required", {"type": "function", "function": {"name": "forecast"}}):
    r = client.chat.completions.create(
        model="default", messages=ask, tools=tools, tool_choice=choice, max_tokens=96,
        temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.tool_calls, c.message
    for call in c.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function", call
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, schemas[call.function.name])
        if not isinstance(choice, str):
            assert call.function.name == "forecast", call

# The same call streamed: the SDK's accumulated deltas hold the whole call.
stream = client.chat.completions.create(
    model="default", messages=ask, tools=tools, tool_choice="required", max_tokens=96,
    temperature=0, stream=True,
)
calls, reason = {}, None
for chunk in stream:
    if not chunk.choices:
        continue
    d = chunk.choices[0].delta
    for tc in d.tool_calls or []:
        entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
        entry["name"] += tc.function.name or ""
        entry["arguments"] += tc.function.arguments or ""
    reason = chunk.choices[0].finish_reason or reason
assert reason == "tool_calls" and calls, (reason, calls)
for entry in calls.values():
    jsonschema.validate(json.loads(entry["arguments"]), schemas[entry["name"]])

# The tool loop goes on: the call, its result, the model's answer.
first = c.message.tool_calls[0]
r = client.chat.completions.create(
    model="default",
    messages=ask + [
        {"role": "assistant", "content": None, "tool_calls": [first.model_dump()]},
        {"role": "tool", "tool_call_id": first.id, "content": "Sunny, 24 C, all three days."},
    ],
    tools=tools,
    tool_choice="none",
    max_tokens=24,
    temperature=0,
)
assert r.choices[0].message.content and not r.choices[0].message.tool_calls, r

# Structured output: json_schema answers validate; json_object answers are objects.
person = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
r = client.chat.completions.create(
    model="default",
    messages=[{"role": "user", "content": "Invent a person: a name and an age."}],
    response_format={"type": "json_schema",
                     "json_schema": {"name": "person", "schema": person, "strict": True}},
    max_tokens=64,
)
jsonschema.validate(json.loads(r.choices[0].message.content), person)
r = client.chat.completions.create(
    model="default",
    messages=[{"role": "user", "content": "Give the name and country of Paris as JSON."}],
    response_format={"type": "json_object"},
    max_tokens=256,
    temperature=0,
)
assert r.choices[0].finish_reason == "stop", r
assert isinstance(json.loads(r.choices[0].message.content), dict), r
for bad in ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
            {"type": "yaml"}):
    try:
        client.chat.completions.create(
            model="default", messages=ask, response_format=bad, max_tokens=4)
        raise AssertionError(f"{bad} accepted")
    except openai.BadRequestError:
        pass

# Log probabilities: one entry per token, the alternatives most likely first.
r = client.chat.completions.create(
    model="default", messages=ask, max_tokens=6, logprobs=True, top_logprobs=3, temperature=0,
)
lp = r.choices[0].logprobs.content
assert len(lp) == r.usage.completion_tokens, (len(lp), r.usage)
for t in lp:
    assert t.logprob <= 0 and len(t.top_logprobs) == 3, t
    assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    # Greedy: the chosen token is the most likely one.
    assert abs(t.logprob - t.top_logprobs[0].logprob) < 1e-4, t
assert "".join(t.token for t in lp) == r.choices[0].message.content

# Same seed, same sampled text (temperature 1, OpenAI's default).
texts = [
    client.chat.completions.create(
        model="default", messages=ask, max_tokens=16, seed=7).choices[0].message.content
    for _ in range(2)
]
assert texts[0] == texts[1], texts

# `n` choices over one prompt: each its own seed (the request's plus its index), so the same
# request gives the same choices.
many = [
    client.chat.completions.create(
        model="default", messages=ask, max_tokens=12, seed=11, n=3)
    for _ in range(2)
]
got = [[c.message.content for c in r.choices] for r in many]
assert [c.index for c in many[0].choices] == [0, 1, 2], many[0]
assert got[0] == got[1], got
assert len(set(got[0])) > 1, f"three seeds, one text: {got[0]}"
u = many[0].usage
assert u.prompt_tokens > 0 and u.completion_tokens >= 3, u
# Streamed, a request has one choice; more than eight are refused.
for bad in [dict(n=2, stream=True), dict(n=9)]:
    try:
        client.chat.completions.create(model="default", messages=ask, max_tokens=4, **bad)
        raise AssertionError(f"accepted {bad}")
    except openai.BadRequestError:
        pass

# `stop`: up to four; a fifth is refused.
try:
    client.chat.completions.create(
        model="default", messages=ask, max_tokens=4, stop=["a", "b", "c", "d", "e"])
    raise AssertionError("five stops accepted")
except openai.BadRequestError:
    pass

print(f"openai tools ok: served {served}, calls {calls}")

# The Responses API: a stored chain reuses its session's KV; the stored response reads back
# and deletes; function calls and their outputs go round.
first = client.responses.create(
    model="default", input="My favourite colour is teal. Say OK.", max_output_tokens=8,
    temperature=0,
)
assert first.status in ("completed", "incomplete"), first
assert first.output_text, first
second = client.responses.create(
    model="default", input="What is my favourite colour?", previous_response_id=first.id,
    max_output_tokens=8, temperature=0,
)
assert second.previous_response_id == first.id
assert second.usage.input_tokens_details.cached_tokens > 0, second.usage
got = client.responses.retrieve(second.id)
assert got.id == second.id and got.output_text == second.output_text, got
called = client.responses.create(
    model="default", input="What will the weather be in Nice for 2 days?",
    tools=[{"type": "function", "name": "forecast", "description": "The weather forecast.",
            "parameters": weather}],
    tool_choice="required", max_output_tokens=96, temperature=0,
)
fcs = [o for o in called.output if o.type == "function_call"]
assert fcs, called.output
jsonschema.validate(json.loads(fcs[0].arguments), weather)
after = client.responses.create(
    model="default", previous_response_id=called.id, max_output_tokens=16, temperature=0,
    input=[{"type": "function_call_output", "call_id": fcs[0].call_id,
            "output": "Sunny, 25 C."}],
)
assert after.output_text, after
assert after.usage.input_tokens_details.cached_tokens > 0, after.usage
# Streamed: the events end in response.completed, whose text is the deltas'.
events = list(client.responses.create(
    model="default", input="Say hello.", max_output_tokens=8, temperature=0, stream=True))
deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
done = [e for e in events if e.type == "response.completed"]
assert done and done[0].response.output_text == deltas, (deltas, done)
assert [e.sequence_number for e in events] == list(range(len(events)))
client.responses.delete(second.id)
try:
    client.responses.retrieve(second.id)
    raise AssertionError("a deleted response was found")
except openai.NotFoundError:
    pass

# Completions, embeddings, the tokenizer.
c = client.completions.create(model="any", prompt="The capital of France is", max_tokens=4,
                              temperature=0, logprobs=2)
assert c.choices[0].text and len(c.choices[0].logprobs.tokens) == c.usage.completion_tokens, c
echo = client.completions.create(model="any", prompt="Hello", max_tokens=2, echo=True,
                                 temperature=0)
assert echo.choices[0].text.startswith("Hello"), echo
e = client.embeddings.create(model="any", input=["a cat", "a dog", "tax law"])
assert len(e.data) == 3 and len(e.data[0].embedding) == 384, e
dot = lambda a, b: sum(x * y for x, y in zip(a, b))
v = [d.embedding for d in e.data]
assert dot(v[0], v[1]) > dot(v[0], v[2]), "cat is nearer dog than tax law"
import base64
import struct
b64 = client.embeddings.create(model="any", input="a cat", encoding_format="base64")
raw = base64.b64decode(b64.data[0].embedding)
floats = struct.unpack(f"<{len(raw) // 4}f", raw)
assert abs(dot(floats, v[0]) - 1.0) < 1e-4
import httpx
tk = httpx.post(f"{base}/tokenize", json={"content": "Hello world"},
                headers={"Authorization": f"Bearer {key}"}).json()
dk = httpx.post(f"{base}/detokenize", json={"tokens": tk["tokens"]},
                headers={"Authorization": f"Bearer {key}"}).json()
assert dk["content"] == "Hello world", (tk, dk)

print(f"openai responses ok: {second.output_text!r}")
