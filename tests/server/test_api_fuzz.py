"""schemathesis against the OpenAPI server's own schema (``/openapi.json``, which describes
the request bodies): generated requests, valid and not, never get a 5xx, every 4xx is an
OpenAI-shaped error body, and the server stays healthy."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.server.test_openai_api import server  # noqa: F401  (a fixture, shared by import)

schemathesis = pytest.importorskip("schemathesis")
EXAMPLES_PER_OPERATION = 25


def test_generated_requests_never_get_a_server_error(server):  # noqa: F811
    base = server[1]
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions"} <= paths, paths
    bodies = [op for op in operations if op.method.upper() == "POST"]
    assert all(op.body for op in bodies), "a POST route without a documented request body"
    for operation in operations:

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def check(case) -> None:
            response = case.call(base_url=base, timeout=30)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text)
            if 400 <= response.status_code < 500:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"]

        check()
    assert httpx.get(base + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_bodies_never_get_a_server_error_or_drop_the_connection(server, path):  # noqa: F811
    """Issue 46: keys that are lone surrogates were a 500 that dropped the keep-alive
    connection. Bodies schemathesis does not make (``fuzz_bodies``), on one connection."""
    from tests.server.fuzz_bodies import CHAT, COMPLETION, bodies, check_answer

    base = server[1]
    valid = CHAT if "chat" in path else COMPLETION
    with httpx.Client(base_url=base, timeout=60, limits=httpx.Limits(max_connections=1)) as client:

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=bodies(valid))
        def check(body: bytes) -> None:
            check_answer(client, "POST", path, body)

        check()
        assert client.get("/health").status_code == 200
