"""The request field `priority` on an fcfs server (the session's): vLLM's 400 naming
`priority` for any value but 0, on completions and chat."""
from __future__ import annotations

import httpx
import pytest
from server_helpers import MODEL, validate

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("priority", [1, -3])
def test_priority_on_an_fcfs_server_is_a_400_naming_it(server_url, path, body, priority):
    r = httpx.post(f"{server_url}{path}", json={**body, "priority": priority}, timeout=60)
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    error = r.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
def test_priority_zero_is_accepted(server_url, path, body):
    r = httpx.post(f"{server_url}{path}", json={**body, "priority": 0}, timeout=60)
    assert r.status_code == 200, r.text


def test_priority_must_be_an_int(server_url):
    r = httpx.post(f"{server_url}/v1/completions", json={**COMPLETION, "priority": "high"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
