"""Schemathesis hooks for the attack suite: keep generation cheap on a CPU.

Only values the spec allows are shrunk (a negative case stays negative): `max_tokens` above 2
becomes 2, and texts within their documented limit are cut to a few hundred characters, so every
generated turn is a short prefill and at most two decoded tokens.
"""

import zlib

import schemathesis

CHEAP_TOKENS = 2
SHORT_TEXT = 300
TEXT_FIELDS = {"message", "content", "text"}
TEXT_LIMIT = 64 * 1024


def _shrink(value):
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in ("max_tokens", "max_completion_tokens") and isinstance(v, int) \
                    and not isinstance(v, bool) and v > CHEAP_TOKENS:
                v = CHEAP_TOKENS
            elif k in TEXT_FIELDS and isinstance(v, str) and SHORT_TEXT < len(v) <= TEXT_LIMIT:
                v = v[:SHORT_TEXT]
            out[k] = _shrink(v)
        return out
    if isinstance(value, list):
        return [_shrink(v) for v in value]
    return value


@schemathesis.hook
def map_body(ctx, body):
    return _shrink(body)


# Half of the generated path parameters name the seeded resources (agent `bot`, session `s`),
# so generated requests also reach real agents, sessions and the engine, not only 404s.
SEEDED = {"agent": "bot", "session": "s", "kind": "axioms"}


@schemathesis.hook
def map_path_parameters(ctx, params):
    if not params:
        return params
    if zlib.crc32(repr(sorted(params.items())).encode()) % 2 == 0:
        return {k: SEEDED.get(k, v) for k, v in params.items()}
    return params
