"""Creates the attack suite's tenants and operator keys.

Two tenants, `victim` and `attack`, each with an agent `bot`, a session `s` and two linked memory
nodes; the victim's agent, turn and nodes hold a marker that must never reach the attacker; the
operator keys of the scopes `read` and `metrics`. Prints one JSON object: the attacker's and the
victim's keys, the victim's marker, agent id and node ids, and the two scoped keys. Arguments:
the base URL and the admin key.
"""

import json
import sys
import urllib.request

MARKER = "VICTIM-7Q4-ZIRCON"


def call(base, method, path, key, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("authorization", "Bearer " + key)
    req.add_header("content-type", "application/json")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read() or b"null")


def tenant(base, admin, name, text):
    t = call(base, "POST", "/v1/admin/tenants", admin, {"name": name})
    key = t["api_key"]
    agent = call(base, "POST", "/v1/agents", key,
                 {"name": "bot", "layers": [{"kind": "axioms", "content": text}]})
    call(base, "POST", "/v1/agents/bot/sessions/s/turns", key,
         {"message": "Hello? " + text, "max_tokens": 2})
    a = call(base, "POST", "/v1/agents/bot/memory/nodes", key,
             {"kind": "fact", "text": "Tea. " + text})
    b = call(base, "POST", "/v1/agents/bot/memory/nodes", key,
             {"kind": "fact", "text": "Milk. " + text})
    call(base, "POST", "/v1/agents/bot/memory/edges", key,
         {"from": a["id"], "to": b["id"], "kind": "relates_to"})
    return t["tenant"]["id"], key, agent["agent"]["id"], [a["id"], b["id"]]


def main():
    base, admin = sys.argv[1], sys.argv[2]
    victim_id, victim, victim_agent, victim_nodes = tenant(
        base, admin, "victim", "Be brief. " + MARKER)
    _, attacker, _, _ = tenant(base, admin, "attack", "Be brief.")
    scoped = {
        s: call(base, "POST", "/v1/admin/keys", admin, {"name": s, "scopes": [s]})["admin_key"]
        for s in ("read", "metrics")
    }
    print(json.dumps({
        "attacker": attacker,
        "victim": victim,
        "victim_tenant": victim_id,
        "victim_agent": victim_agent,
        "victim_nodes": victim_nodes,
        "marker": MARKER,
        "read": scoped["read"],
        "metrics": scoped["metrics"],
    }))


if __name__ == "__main__":
    main()
