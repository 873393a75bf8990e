"""The official anthropic SDK against a running Engram server: Messages with a system text,
content blocks, a tool loop (a forced call constrained to its schema), streaming events, stop
sequences and count_tokens (run by tests/e2e/openai.rs).

usage: anthropic_sdk.py BASE_URL API_KEY
"""
import json
import sys

import anthropic
import jsonschema

base, key = sys.argv[1:3]
client = anthropic.Anthropic(base_url=base, api_key=key)

m = client.messages.create(
    model="claude-sonnet-4-5", max_tokens=16,
    system="Answer in a few words.",
    messages=[{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}],
)
assert m.type == "message" and m.role == "assistant", m
assert m.content and m.content[0].type == "text" and m.content[0].text, m
assert m.stop_reason in ("end_turn", "max_tokens"), m.stop_reason
assert m.usage.output_tokens > 0

again = client.messages.create(
    model="claude-sonnet-4-5", max_tokens=16, system="Answer in a few words.",
    messages=[{"role": "user", "content": "What is the capital of France?"}],
)
assert again.usage.cache_read_input_tokens > 0, again.usage

schema = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
tools = [{"name": "forecast", "description": "The weather forecast of a city.",
          "input_schema": schema}]
ask = [{"role": "user", "content": "The weather in Paris for 2 days, please."}]
m = client.messages.create(model="any", max_tokens=96, tools=tools,
                           tool_choice={"type": "any"}, messages=ask)
uses = [b for b in m.content if b.type == "tool_use"]
assert m.stop_reason == "tool_use" and uses, m
jsonschema.validate(uses[0].input, schema)
m2 = client.messages.create(
    model="any", max_tokens=24, tools=tools,
    messages=ask + [
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "Sunny, 22 C both days."}]},
    ],
)
assert m2.content and m2.content[0].type == "text", m2

# Streaming: the SDK assembles the final message from the events.
with client.messages.stream(model="any", max_tokens=96, tools=tools,
                            tool_choice={"type": "tool", "name": "forecast"},
                            messages=ask) as s:
    final = s.get_final_message()
streamed = [b for b in final.content if b.type == "tool_use"]
assert final.stop_reason == "tool_use" and streamed, final
jsonschema.validate(streamed[0].input, schema)
with client.messages.stream(model="any", max_tokens=12,
                            messages=[{"role": "user", "content": "Count: one, two,"}]) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
assert text == final.content[0].text, (text, final)

m = client.messages.create(model="any", max_tokens=64, stop_sequences=["three"],
                           messages=[{"role": "user", "content": "Count from one to five in words."}])
if m.stop_reason == "stop_sequence":
    assert m.stop_sequence == "three"

n = client.messages.count_tokens(model="any", messages=ask, tools=tools)
assert n.input_tokens > 20, n

try:
    client.messages.create(model="any", max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    raise AssertionError("an image block was accepted")
except anthropic.BadRequestError:
    pass

print(f"anthropic sdk ok: {uses[0].input}")
