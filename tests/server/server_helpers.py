"""Helpers for the server tests: schema validation, SSE parsing, /metrics scraping."""
from __future__ import annotations

import json
import pathlib
import time

import httpx
from jsonschema import Draft202012Validator
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny"
# The README examples name the default model; the tiny server answers to it too.
SERVED_NAMES = (MODEL, "SmolLM2-135M-Instruct")
MAX_MODEL_LEN = 256
# OpenAI's published response schemas (a subset of openai/openai-openapi, MIT).
SCHEMAS = json.loads(
    pathlib.Path(__file__).with_name("openai-response-schemas.json").read_text())


def validate(name: str, obj: dict, nullable_finish_reason: bool = False) -> None:
    """Check ``obj`` against OpenAI's published schema ``name``.

    ``nullable_finish_reason``: OpenAI's spec shares CreateCompletionResponse between
    streamed and whole responses but lists no null finish_reason, which every
    unfinished streamed chunk (OpenAI's own included) carries.
    """
    doc = json.loads(json.dumps(SCHEMAS))
    if nullable_finish_reason:
        choice = doc["components"]["schemas"][name]["properties"]["choices"]["items"]
        choice["properties"]["finish_reason"] = {"type": ["string", "null"]}
    Draft202012Validator({**doc, "$ref": f"#/components/schemas/{name}"}).validate(obj)


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of an SSE response; asserts it ends with [DONE]."""
    events = [line[len("data: "):] for line in response.text.splitlines()
              if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", response.text[-500:]
    return [json.loads(e) for e in events[:-1]]


def scrape(url: str) -> dict[str, dict]:
    """/metrics as {sample name: {labels tuple: value}}, without the labels every
    series of one server shares (model_name, engine)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "engine")))
            out.setdefault(s.name, {})[labels] = s.value
    return out


def metric(url: str, name: str, **labels) -> float:
    return scrape(url)[name].get(tuple(sorted(labels.items())), 0.0)


def wait_until_idle(url: str, timeout: float = 30.0) -> dict:
    """Poll /metrics until nothing runs or waits; return the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        busy = (m["vllm:num_requests_running"][()], m["vllm:num_requests_waiting"][()])
        if busy == (0, 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)
