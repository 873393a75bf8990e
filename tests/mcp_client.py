"""The official MCP Python SDK's client against Engram's /mcp (run by tests/e2e/openai.rs):
lists the tools, adds two memories, links them, recalls, runs a turn, forgets one; a wrong key
is refused.

usage: mcp_client.py BASE_URL API_KEY AGENT
"""
import asyncio
import json
import sys

import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

base, key, agent = sys.argv[1:4]


def payload(result):
    if result.structured_content is not None:
        return result.structured_content
    return json.loads(result.content[0].text)


async def main():
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx2.AsyncClient(headers=headers, timeout=120) as http, \
            streamable_http_client(f"{base}/mcp", http_client=http) as streams:
        read, write = streams[0], streams[1]
        async with ClientSession(read, write) as s:
            await s.initialize()
            names = sorted(t.name for t in (await s.list_tools()).tools)
            assert names == ["add_memory", "forget_memory", "link_memories", "query_memories",
                             "run_turn"], names
            a = payload(await s.call_tool("add_memory", {
                "agent": agent, "text": "The vault opens on Tuesdays."}))
            b = payload(await s.call_tool("add_memory", {
                "agent": agent, "text": "Only staff may enter the vault.", "kind": "fact"}))
            assert a["id"] != b["id"], (a, b)
            e = payload(await s.call_tool("link_memories", {
                "agent": agent, "from": a["id"], "to": b["id"], "kind": "relates_to"}))
            assert e["from_id"] == a["id"], e
            hits = payload(await s.call_tool("query_memories", {
                "agent": agent, "text": "When does the vault open?"}))["results"]
            texts = [h["node"]["text"] if "node" in h else h.get("text") for h in hits]
            assert "The vault opens on Tuesdays." in texts, hits
            turn = payload(await s.call_tool("run_turn", {
                "agent": agent, "session": "mcp", "message": "Hello!", "max_tokens": 8}))
            assert turn["text"] and turn["usage"]["completion_tokens"] > 0, turn
            bad = await s.call_tool("forget_memory", {"agent": "no-such-agent", "id": a["id"]})
            assert bad.is_error and payload(bad)["code"] == "not_found", bad
            gone = payload(await s.call_tool("forget_memory", {"agent": agent, "id": a["id"]}))
            assert gone["deleted"] == a["id"], gone
            hits = payload(await s.call_tool("query_memories", {
                "agent": agent, "text": "When does the vault open?"}))["results"]
            assert all(a["id"] != (h["node"]["id"] if "node" in h else h.get("id")) for h in hits)
    r = httpx2.post(f"{base}/mcp", headers={"Authorization": "Bearer nope"},
                   json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert r.status_code == 401, r.status_code
    print(f"mcp ok: {names}")


asyncio.run(main())
