"""One agent framework end to end (issue 67, item 7): the OpenAI Agents SDK (`openai-agents`)
runs a two-turn shopping task with two tools — a price table and a calculator — against
Engram serving Qwen2.5-Coder-1.5B-Instruct over chat completions (run by tests/e2e/openai.rs).

The first model call of each turn must call the price table (`tool_choice` naming it, which
Engram constrains to its schema); the SDK then lets the model choose, and the run ends with the
calculator's answer. Checked: both turns
complete, every tool call the model made parses and validates against its tool's schema, the
price table is read for every fruit asked about, and every model call after the first reports
cached prompt tokens. The conversation is a session (`user`), which the SDK resends whole on
every call: Engram matches it against the session's log, so no call forks it.

usage: agents_framework.py BASE_URL API_KEY
"""

import asyncio
import ast
import json
import operator
import sys

import jsonschema
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    StopAtTools,
    function_tool,
    set_tracing_disabled,
)
from agents.tool import FunctionTool
from openai import AsyncOpenAI

base, key = sys.argv[1], sys.argv[2]
set_tracing_disabled(True)

PRICES = {"apple": 3, "pear": 5, "melon": 7}
looked_up: list[str] = []
computed: list[str] = []


@function_tool
def price(fruit: str) -> str:
    """The price of one fruit, in euros (apple, pear or melon)."""
    name = fruit.strip().lower().rstrip("s")
    looked_up.append(name)
    if name not in PRICES:
        return f"unknown fruit {fruit!r}; known: {', '.join(PRICES)}"
    return f"one {name} costs {PRICES[name]} euros"


OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError("only numbers and + - * /")


@function_tool
def calculate(expression: str) -> str:
    """Evaluates an arithmetic expression of numbers and + - * /."""
    computed.append(expression)
    try:
        value = _eval(ast.parse(expression, mode="eval"))
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(value)


TOOLS = {t.name: t for t in (price, calculate) if isinstance(t, FunctionTool)}

client = AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=600)
agent = Agent(
    name="shop",
    instructions=(
        "You are a shop assistant. First look up the price of each fruit with the `price` "
        "tool, one call per fruit; then compute the total with one `calculate` call."
    ),
    tools=[price, calculate],
    model=OpenAIChatCompletionsModel(model="default", openai_client=client),
    model_settings=ModelSettings(
        # The first call of a turn is a lookup (forced, so constrained to `price`'s schema);
        # the SDK then lets the model choose.
        tool_choice="price",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=96,
        extra_body={"user": "shopper@example.com"},
    ),
    # The task ends with its sum: the calculator's answer is the run's output.
    tool_use_behavior=StopAtTools(stop_at_tool_names=["calculate"]),
)


def calls_of(result):
    """Every tool call the model made in a run, with its usage per model call."""
    calls, usage = [], []
    for r in result.raw_responses:
        usage.append((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens))
        for item in r.output:
            if getattr(item, "type", None) == "function_call":
                calls.append((item.name, item.arguments))
    return calls, usage


async def main():
    turns = [
        "How much do 4 apples and 3 pears cost together?",
        "And how much would 2 melons add to that?",
    ]
    history = []
    all_calls, all_usage = [], []
    for ask in turns:
        try:
            result = await Runner.run(
                agent, history + [{"role": "user", "content": ask}], max_turns=8
            )
        except Exception as e:
            # What the model did, for the failure's report.
            data = getattr(e, "run_data", None)
            for item in getattr(data, "new_items", []) or []:
                print("  ", type(item).__name__, getattr(item, "raw_item", item))
            raise
        assert result.final_output, f"no answer to {ask!r}"
        calls, usage = calls_of(result)
        assert calls, f"no tool call for {ask!r}"
        all_calls += calls
        all_usage += usage
        history = result.to_input_list()
        print(f"{ask} -> {result.final_output!r} ({len(calls)} calls)")
    # Every call parses and validates against its tool's schema.
    for name, arguments in all_calls:
        assert name in TOOLS, f"a call of an unknown tool {name!r}"
        jsonschema.validate(json.loads(arguments), TOOLS[name].params_json_schema)
    for fruit in ("apple", "pear", "melon"):
        assert fruit in looked_up, f"{fruit} never looked up: {looked_up}"
    # After the first model call, the prompt's earlier part comes from the cache.
    for i, (prompt, cached) in enumerate(all_usage[1:], start=2):
        assert cached > 0, f"model call {i} reused nothing: {all_usage}"
    share = sum(c for _, c in all_usage[1:]) / sum(p for p, _ in all_usage[1:])
    print(
        f"agents framework ok: {len(all_calls)} tool calls, {len(all_usage)} model calls, "
        f"cached share after the first {share:.2f}, lookups {looked_up}, sums {computed}"
    )


asyncio.run(main())
