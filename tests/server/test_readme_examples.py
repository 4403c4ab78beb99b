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
STRUCTURED_CURL = ROOT / "docs" / "structured_outputs.sh"
STRUCTURED_SDK = ROOT / "docs" / "structured_outputs.py"
TOOLS_SDK = ROOT / "docs" / "tool_calls.py"
REASONING_CURL = ROOT / "docs" / "reasoning.sh"
CITY = {"type": "object", "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "population_millions": {"type": "integer", "minimum": 0, "maximum": 40}},
        "required": ["name", "population_millions"]}


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
    for example in (CURL_EXAMPLE, SDK_EXAMPLE, STRUCTURED_CURL, STRUCTURED_SDK, TOOLS_SDK,
                    REASONING_CURL):
        assert example.read_text().strip() in text, f"README.md lacks {example.name} verbatim"


def test_structured_outputs_curl_example(default_model_url):
    from jsonschema import Draft202012Validator
    schema_reply, choice_reply = map(json.loads, _run(["bash", str(STRUCTURED_CURL)],
                                                     default_model_url).splitlines())
    for reply in (schema_reply, choice_reply):
        validate("CreateChatCompletionResponse", reply)
    Draft202012Validator(CITY).validate(
        json.loads(schema_reply["choices"][0]["message"]["content"]))
    assert choice_reply["choices"][0]["message"]["content"] in ("yes", "no")


def test_structured_outputs_sdk_example(default_model_url):
    name, population = _run([sys.executable, str(STRUCTURED_SDK)],
                            default_model_url).strip().rsplit(" ", 1)
    assert name and 0 <= int(population) <= 40


def test_tool_calls_example(default_model_url):
    call_line, answer_line = _run([sys.executable, str(TOOLS_SDK)],
                                  default_model_url).strip().splitlines()
    name, arguments = call_line.split(" ", 1)
    assert name == "get_weather" and "city" in arguments
    assert answer_line.startswith("None | ")       # the default model does not think


def test_reasoning_example(default_model_url):
    reply = json.loads(_run(["bash", str(REASONING_CURL)], default_model_url))
    validate("CreateChatCompletionResponse", reply)
    message = reply["choices"][0]["message"]
    assert message["content"] and message.get("reasoning") is None
