"""Generates a Python client from the committed OpenAPI document with openapi-python-client and
drives the real service through it: a tenant, an agent, a turn, a memory node, and a session's
cache exported and imported into another session. Every answer must parse into its generated,
typed model (an untyped or wrongly typed response fails here).

usage: openapi_client.py SPEC BASE_URL ADMIN_KEY"""

import io
import os
import subprocess
import sys
import tempfile


def main() -> None:
    spec, base, admin = sys.argv[1:4]
    work = tempfile.mkdtemp(prefix="engram-client-")
    out = os.path.join(work, "engram_client")
    generator = os.path.join(os.path.dirname(sys.executable), "openapi-python-client")
    subprocess.run(
        [generator, "generate", "--path", spec, "--meta", "none", "--output-path", out],
        check=True,
        cwd=work,
    )
    sys.path.insert(0, work)

    from engram_client import AuthenticatedClient
    from engram_client.api.admin import create_tenant
    from engram_client.api.agents import create_agent, get_agent
    from engram_client.api.memory import create_node
    from engram_client.api.sessions import create_turn, export, import_
    from engram_client.models import (
        AgentView,
        CacheOpResponse,
        CreatedTenant,
        LayerInput,
        MemoryNodeRow,
        NewAgent,
        NewNode,
        NewTenant,
        TurnRequest,
        TurnResponse,
    )
    from engram_client.types import File

    def typed(value, cls):
        assert isinstance(value, cls), f"expected {cls.__name__}, got {value!r}"
        return value

    operator = AuthenticatedClient(base_url=base, token=admin, timeout=300)
    created = typed(create_tenant.sync(client=operator, body=NewTenant(name="generated")), CreatedTenant)
    assert created.tenant.name == "generated"
    assert created.key.tenant_id == created.tenant.id

    client = AuthenticatedClient(base_url=base, token=created.api_key, timeout=300)
    agent = typed(
        create_agent.sync(
            client=client,
            body=NewAgent(name="bot", layers=[LayerInput(kind="axioms", content="Answer briefly.")]),
        ),
        AgentView,
    )
    assert agent.agent.name == "bot" and agent.layers[0].kind == "axioms"
    again = typed(get_agent.sync("bot", client=client), AgentView)
    assert again.agent.id == agent.agent.id

    node = typed(
        create_node.sync("bot", client=client, body=NewNode(kind="fact", text="The sky over Lisbon was violet.")),
        MemoryNodeRow,
    )
    assert node.text.startswith("The sky")

    turn = typed(
        create_turn.sync("bot", "s1", client=client, body=TurnRequest(message="Name a colour.", max_tokens=8)),
        TurnResponse,
    )
    assert turn.usage.completion_tokens > 0 and turn.text
    assert turn.finish_reason.value in ("stop", "length")

    exported = typed(export.sync("bot", "s1", client=client), File)
    data = exported.payload.read()
    assert len(data) > 1024, len(data)
    loaded = typed(
        import_.sync(
            "bot",
            "s2",
            client=client,
            body=File(payload=io.BytesIO(data), file_name="s1.safetensors", mime_type="application/octet-stream"),
        ),
        CacheOpResponse,
    )
    assert loaded.blocks > 0, loaded
    print(f"openapi client ok: turn {turn.usage.prompt_tokens} prompt tokens, {loaded.blocks} blocks imported")


if __name__ == "__main__":
    main()
