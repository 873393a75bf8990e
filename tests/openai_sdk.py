"""The official openai SDK against a running Engram server (run by the e2e tests).

usage: openai_sdk.py BASE_URL API_KEY AGENT
"""
import sys

import openai

base, key, agent = sys.argv[1:4]
client = openai.OpenAI(base_url=f"{base}/v1", api_key=key)

models = [m.id for m in client.models.list().data]
assert agent in models, models

question = [{"role": "user", "content": "What is the capital of France?"}]
first = client.chat.completions.create(
    model=agent, messages=question, max_tokens=16, user="sdk-session", temperature=0
)
answer = first.choices[0].message.content
assert "Paris" in answer, answer
assert first.usage.prompt_tokens > 0

second = client.chat.completions.create(
    model=agent,
    messages=[{"role": "user", "content": "And of Italy?"}],
    max_tokens=8,
    user="sdk-session",
)
cached = second.usage.prompt_tokens_details.cached_tokens
assert cached > 0, second.usage

stream = client.chat.completions.create(
    model=agent,
    messages=question,
    max_tokens=16,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
pieces, usage = [], None
for chunk in stream:
    if chunk.choices:
        pieces.append(chunk.choices[0].delta.content or "")
    if chunk.usage is not None:
        usage = chunk.usage
text = "".join(pieces)
assert "Paris" in text, text
assert usage is not None and usage.completion_tokens > 0

# A name that is no agent's is the tenant's default agent (as llama.cpp accepts any name).
other = client.chat.completions.create(model="no-such-agent", messages=question, max_tokens=4)
assert other.model == "default", other.model

# A system prompt, as every agent framework sends one: added to the agent's stable rules, so a
# repeated request reuses at least its full blocks (16 tokens each).
system = "You are a careful travel assistant. " * 12
asked = [{"role": "system", "content": system}, {"role": "user", "content": "Name a city."}]
once = client.chat.completions.create(model=agent, messages=asked, max_tokens=4)
again = client.chat.completions.create(model=agent, messages=asked, max_tokens=4)
system_tokens = once.usage.prompt_tokens - first.usage.prompt_tokens
reused = again.usage.prompt_tokens_details.cached_tokens
assert system_tokens > 48, (once.usage, first.usage)
assert reused >= system_tokens // 16 * 16, (reused, system_tokens)
assert once.id != again.id, "completion ids collide"

# An agent's tool loop: the model asked for a tool, the tool answered; the model goes on.
call = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
}
looped = client.chat.completions.create(
    model=agent,
    messages=[
        {"role": "system", "content": "Use the tools' results."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."},
    ],
    max_tokens=8,
)
assert looped.choices[0].message.content, looped
assert looped.usage.prompt_tokens > 0

for bad, code in (
    ({"n": 9}, "invalid_request"),
    ({"n": 2, "stream": True}, "unsupported_parameter"),
):
    try:
        client.chat.completions.create(model=agent, messages=question, max_tokens=4, **bad)
        raise AssertionError(f"{bad} accepted")
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        assert body.get("code") == code, (e, e.body)

print(f"openai sdk ok: {answer!r}, second turn cached {cached}, streamed {text!r}")
