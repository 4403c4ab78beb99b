"""The README's client examples (docs/openai_examples.sh, docs/openai_example.py, which
the README includes verbatim) run as written against the server."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from server_helpers import validate

ROOT = pathlib.Path(__file__).resolve().parents[2]
CURL_EXAMPLE = ROOT / "docs" / "openai_examples.sh"
SDK_EXAMPLE = ROOT / "docs" / "openai_example.py"


def _run(args: list[str], server_url: str) -> str:
    env = {**os.environ, "OPENAI_BASE_URL": f"{server_url}/v1"}
    env.pop("OPENAI_API_KEY", None)
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_curl_example(server_url):
    out = _run(["bash", str(CURL_EXAMPLE)], server_url)
    chat_line, *stream_lines = out.splitlines()
    chat = json.loads(chat_line)
    validate("CreateChatCompletionResponse", chat)
    assert chat["choices"][0]["message"]["content"]
    events = [line for line in stream_lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2
    for event in events[:-1]:
        validate("CreateCompletionResponse", json.loads(event[6:]), nullable_finish_reason=True)


def test_sdk_example(server_url):
    out = _run([sys.executable, str(SDK_EXAMPLE)], server_url)
    assert out.strip()


def test_readme_includes_examples_verbatim():
    readme = ROOT / "README.md"
    if not readme.exists():
        pytest.skip("no README.md yet")
    text = readme.read_text()
    for example in (CURL_EXAMPLE, SDK_EXAMPLE):
        assert example.read_text().strip() in text, f"README.md lacks {example.name} verbatim"
