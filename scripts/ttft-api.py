#!/usr/bin/env python3
"""TTFT of an agent's first and second turn through the REST API.

Starts nothing: point it at a running `engram serve` with an admin key. The agent's stable
layers are cut from the Debian license texts to about --stable-tokens tokens (≈4 chars per token);
turn 2 changes only the clock layer, so it should reuse everything before the volatile block.

usage: ttft-api.py [--base http://127.0.0.1:8080] [--admin-key KEY] [--stable-tokens 6000]
"""
import argparse
import json
import os
import time
import urllib.request


def call(base, method, path, key, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("authorization", f"Bearer {key}")
    req.add_header("content-type", "application/json")
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="http://127.0.0.1:8080")
    ap.add_argument("--admin-key", default=os.environ.get("ENGRAM__AUTH__ADMIN_KEY", ""))
    ap.add_argument("--stable-tokens", type=int, default=6000)
    args = ap.parse_args()
    text = open("/usr/share/common-licenses/GPL-3").read()
    chars = args.stable_tokens * 4
    lines = [l for l in text.splitlines() if l.strip()]
    body, n = [], 0
    for l in lines:
        if n + len(l) > chars:
            break
        body.append(l)
        n += len(l)
    # Split over rules and capabilities; budgets large enough to keep everything.
    half = len(body) // 2
    name = f"ttft{int(time.time())}"
    t = call(args.base, "POST", "/v1/admin/tenants", args.admin_key, {"name": name})
    key = t["api_key"]
    layers = [
        {"kind": "axioms", "content": "! Answer briefly."},
        {"kind": "rules", "content": "\n".join(body[:half]), "budget": 20000},
        {"kind": "capabilities", "content": "\n".join(body[half:]), "budget": 20000},
        {"kind": "current_time", "content": "2026-11-21 09:00"},
    ]
    call(args.base, "POST", "/v1/agents", key, {"name": "bench", "layers": layers})
    turn = lambda msg: call(
        args.base, "POST", "/v1/agents/bench/sessions/s1/turns", key,
        {"message": msg, "max_tokens": 4},
    )
    first = turn("Summarize section 1 in one line.")
    call(args.base, "PUT", "/v1/agents/bench/layers/current_time", key, {"content": "2026-11-21 09:05"})
    second = turn("And section 2?")
    out = {
        "prompt_tokens": second["usage"]["prompt_tokens"],
        "first_ttft_ms": first["ttft_ms"],
        "second_ttft_ms": second["ttft_ms"],
        "second_cached_tokens": second["usage"]["cached_tokens"],
        "ratio": first["ttft_ms"] / second["ttft_ms"],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
