"""Creates the attack suite's tenant: an agent `bot`, a session `s`, two linked nodes.

Prints the tenant's API key. Arguments: the base URL and the admin key.
"""

import json
import sys
import urllib.request


def call(base, method, path, key, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("authorization", "Bearer " + key)
    req.add_header("content-type", "application/json")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read() or b"null")


def main():
    base, admin = sys.argv[1], sys.argv[2]
    t = call(base, "POST", "/v1/admin/tenants", admin, {"name": "attack"})
    key = t["api_key"]
    call(base, "POST", "/v1/agents", key,
         {"name": "bot", "layers": [{"kind": "axioms", "content": "Be brief."}]})
    call(base, "POST", "/v1/agents/bot/sessions/s/turns", key,
         {"message": "Hello?", "max_tokens": 2})
    a = call(base, "POST", "/v1/agents/bot/memory/nodes", key, {"kind": "fact", "text": "Tea."})
    b = call(base, "POST", "/v1/agents/bot/memory/nodes", key, {"kind": "fact", "text": "Milk."})
    call(base, "POST", "/v1/agents/bot/memory/edges", key,
         {"from": a["id"], "to": b["id"], "kind": "relates_to"})
    print(key)


if __name__ == "__main__":
    main()
