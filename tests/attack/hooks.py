"""Schemathesis hooks for the attack suite: keep generation cheap on a CPU, and look for
cross-tenant reads and scope escapes.

Only values the spec allows are shrunk (a negative case stays negative): `max_tokens` above 2
becomes 2, and texts within their documented limit are cut to a few hundred characters, so every
generated turn is a short prefill and at most two decoded tokens.

`ATTACK_ROLE` (set by run.sh per run) says who is calling: `tenant` (the attacker tenant on its
own resources), `cross` (the attacker, with path parameters naming the victim tenant's agent id,
node ids and tenant id), `read` or `metrics` (operator keys of those scopes on the operator
routes), `stateful` (schemathesis's stateful phase, following the spec's links: the operations
that create a resource — agents, sessions by their turns, forks, nodes, edges — run as the
victim, with the victim's marker in their texts, and the operations the links lead to run as the
attacker on what the victim just made). `ATTACK_SEED` is seed.py's JSON. Two checks of this suite's own: no answer to the
attacker holds the victim's marker, and no operator key does what its scope does not allow.
"""

import json
import os
import re
import zlib

import schemathesis

ROLE = os.environ.get("ATTACK_ROLE", "tenant")
SEED = json.loads(os.environ.get("ATTACK_SEED", "{}"))

CHEAP_TOKENS = 2
SHORT_TEXT = 300
TEXT_FIELDS = {"message", "content", "text"}
TEXT_LIMIT = 64 * 1024


def _shrink(value, mark=False):
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in ("max_tokens", "max_completion_tokens") and isinstance(v, int) \
                    and not isinstance(v, bool) and v > CHEAP_TOKENS:
                v = CHEAP_TOKENS
            elif k in TEXT_FIELDS and isinstance(v, str) and SHORT_TEXT < len(v) <= TEXT_LIMIT:
                v = v[:SHORT_TEXT]
            # The victim's texts carry its marker (valid texts only: a negative case stays one).
            if mark and k in TEXT_FIELDS and isinstance(v, str) and v.strip() \
                    and len(v) <= SHORT_TEXT:
                v = v + " " + SEED.get("marker", "")
            out[k] = _shrink(v, mark)
        return out
    if isinstance(value, list):
        return [_shrink(v, mark) for v in value]
    return value


# The operations that create what the links lead from: in the `stateful` role, the victim's.
PRODUCERS = {
    ("POST", "/v1/agents"),
    ("POST", "/v1/agents/{agent}/sessions/{session}/turns"),
    ("POST", "/v1/agents/{agent}/sessions/{session}/fork"),
    ("POST", "/v1/agents/{agent}/memory/nodes"),
    ("POST", "/v1/agents/{agent}/memory/edges"),
}


def _as_victim(operation):
    return ROLE == "stateful" and (operation.method.upper(), operation.path) in PRODUCERS


@schemathesis.hook
def map_body(ctx, body):
    return _shrink(body, mark=ctx.operation is not None and _as_victim(ctx.operation))


@schemathesis.hook
def before_call(ctx, case, kwargs):
    """In the `stateful` role each call carries the victim's or the attacker's key."""
    if ROLE != "stateful":
        return
    key = SEED["victim"] if _as_victim(case.operation) else SEED["attacker"]
    headers = dict(case.headers or {})
    headers["Authorization"] = "Bearer " + key
    case.headers = headers


# In the `stateful` role: the agents the victim created in this run (names from their 201
# answers), and a line per attacker call on one of them in ATTACK_TRACE (run.sh counts them: the
# sequences must cross tenants, not only exist).
VICTIM_AGENTS = set()
TRACE = os.environ.get("ATTACK_TRACE")


@schemathesis.hook
def after_call(ctx, case, response):
    if ROLE != "stateful":
        return
    if _as_victim(case.operation):
        if case.path == "/v1/agents" and response.status_code == 201:
            try:
                VICTIM_AGENTS.add(json.loads(response.content)["agent"]["name"])
            except (ValueError, KeyError, TypeError):
                pass
        return
    agent = (case.path_parameters or {}).get("agent")
    if TRACE and agent in VICTIM_AGENTS:
        with open(TRACE, "a") as f:
            f.write(f"{case.method} {case.path} {response.status_code}\n")


def _by_attacker(case):
    if ROLE in ("tenant", "cross"):
        return True
    if ROLE == "stateful":
        return (case.headers or {}).get("Authorization") == "Bearer " + SEED.get("attacker", "")
    return False


# Half of the generated path parameters name the seeded resources (agent `bot`, session `s`),
# so generated requests also reach real agents, sessions and the engine, not only 404s.
SEEDED = {"agent": "bot", "session": "s", "kind": "axioms"}


def _victim(params):
    """The victim's resources under the attacker's key: its agent by id, its nodes, itself."""
    nodes = SEED.get("victim_nodes") or [0]
    out = dict(params)
    for k in out:
        if k == "agent":
            out[k] = SEED.get("victim_agent", out[k])
        elif k == "id":
            out[k] = nodes[zlib.crc32(repr(out).encode()) % len(nodes)]
        elif k == "tenant":
            out[k] = SEED.get("victim_tenant", out[k])
        elif k in SEEDED:
            out[k] = SEEDED[k]
    return out


NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _valid(params):
    """Whether the generated names are valid ones: a negative case (a name the spec refuses)
    keeps its names, so it stays negative."""
    return all(NAME.match(str(v)) for k, v in params.items() if k in ("agent", "session"))


@schemathesis.hook
def map_path_parameters(ctx, params):
    if not params or not _valid(params):
        return params
    if zlib.crc32(repr(sorted(params.items())).encode()) % 2 == 0:
        if ROLE == "cross":
            return _victim(params)
        return {k: SEEDED.get(k, v) for k, v in params.items()}
    return params


@schemathesis.check
def no_cross_tenant_read(ctx, response, case):
    """The attacker's answers never hold the victim's marker."""
    marker = SEED.get("marker")
    # Bytes, not text: an exported cache file is binary.
    if _by_attacker(case) and marker and marker.encode() in (response.content or b""):
        raise AssertionError(
            f"cross-tenant read: {case.method} {case.formatted_path} answered the victim's text")


@schemathesis.check
def scope_respected(ctx, response, case):
    """A `read` key changes nothing; a `metrics` key reads no operator view."""
    if response.status_code >= 400 or not case.path.startswith("/v1/admin"):
        return
    if ROLE == "read" and case.method.upper() != "GET":
        raise AssertionError(f"a read key did {case.method} {case.formatted_path}")
    if ROLE == "metrics":
        raise AssertionError(f"a metrics key did {case.method} {case.formatted_path}")
