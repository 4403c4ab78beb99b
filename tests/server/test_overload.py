"""--max-waiting-requests: a flood against a tiny-model server bounded at 3 waiting
requests. The engine's steps are held (a gate) while the flood arrives, so no request
gets its first token and exactly the bound is accepted: the count is deterministic,
not a race. The rest get a 429 at once (Retry-After, OpenAI's error shape); once the
gate opens every accepted request completes with 200, and the counts add up."""
from __future__ import annotations

import concurrent.futures
import threading

import httpx
import pytest
from server_helpers import MODEL, SERVED_NAMES, scrape, sse_events, validate

from jaxllm.config import engine_config_from_flat

BOUND = 3
MAX_TOKENS = 4


class Gate:
    """Holds every engine step until opened (set as the engine's `step` in setup)."""

    def __init__(self):
        self.open = threading.Event()

    def __call__(self, engine):
        step = engine.step

        def held_step():
            self.open.wait(120)
            return step()
        engine.step = held_step


@pytest.fixture(scope="module")
def overload(tiny_model):
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app, serve_in_background
    folder, _ = tiny_model("llama")
    config = engine_config_from_flat(
        model=folder, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
        num_gpu_blocks_override=64, enforce_eager=True, served_model_name=SERVED_NAMES,
        max_waiting_requests=BOUND)
    gate = Gate()
    engine = AsyncLLM.from_config(config, multiprocess=False, setup=gate)
    try:
        with serve_in_background(build_app(engine, config)) as url:
            yield url, engine, gate
    finally:
        gate.open.set()
        engine.shutdown()


def body(i: int) -> tuple[str, dict]:
    """Completions and streamed chats, alternately."""
    if i % 2 == 0:
        return "/v1/completions", {"model": MODEL, "prompt": f"hello {i}", "temperature": 0,
                                   "max_tokens": MAX_TOKENS, "ignore_eos": True}
    return "/v1/chat/completions", {"model": MODEL, "stream": True, "temperature": 0,
                                    "messages": [{"role": "user", "content": f"hi {i}"}],
                                    "max_tokens": MAX_TOKENS, "ignore_eos": True}


def post(url: str, i: int) -> httpx.Response:
    path, payload = body(i)
    return httpx.post(f"{url}{path}", json=payload, timeout=120)


def check_429(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    validate("ErrorResponse", r.json())
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "too_many_waiting_requests" and error["type"] == "rate_limit_error"
    assert "--max-waiting-requests 3" in error["message"]


def check_completed(i: int, r: httpx.Response) -> None:
    assert r.status_code == 200, r.text
    if i % 2 == 0:
        (choice,) = r.json()["choices"]
        assert choice["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    else:
        events = sse_events(r)
        assert events[-1]["choices"][0]["finish_reason"] == "length"


def rejected_total(url: str) -> float:
    samples = scrape(url).get("jaxllm:request_rejected_total", {})
    return samples.get((("reason", "max_waiting_requests"),), 0.0)


def succeeded_total(url: str) -> float:
    return sum(scrape(url)["vllm:request_success_total"].values())


def test_flood_gets_429s_and_every_accepted_request_completes(overload):
    url, engine, gate = overload
    gate.open.clear()
    rejected0, succeeded0 = rejected_total(url), succeeded_total(url)
    flood = 12
    with concurrent.futures.ThreadPoolExecutor(flood) as pool:
        futures = {pool.submit(post, url, i): i for i in range(flood)}
        done = []
        for future in concurrent.futures.as_completed(futures, timeout=120):
            done.append((futures[future], future.result()))
            if len(done) == flood - BOUND:
                break
        # Nothing has had a token yet: the first answers are the refusals.
        for _, r in done:
            check_429(r)
        assert engine.num_waiting_requests == BOUND
        gate.open.set()
        accepted = [(futures[f], f.result()) for f in futures if futures[f] not in dict(done)]
    assert len(accepted) == BOUND
    for i, r in accepted:
        check_completed(i, r)
    assert rejected_total(url) - rejected0 == flood - BOUND
    assert succeeded_total(url) - succeeded0 == BOUND
    assert engine.num_waiting_requests == 0
    # And the server takes requests again.
    check_completed(0, post(url, 0))


def test_a_multi_prompt_request_past_the_bound_leaves_nothing_queued(overload):
    """Five prompts, three places: the request is a 429 and its admitted prompts are
    aborted, so the next requests find the whole bound free."""
    url, engine, gate = overload
    gate.open.clear()
    rejected0 = rejected_total(url)
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": [f"p{i}" for i in range(5)], "max_tokens": MAX_TOKENS})
    check_429(r)
    assert engine.num_waiting_requests == 0
    assert rejected_total(url) - rejected0 == 1
    gate.open.set()
    with concurrent.futures.ThreadPoolExecutor(BOUND) as pool:
        results = list(pool.map(lambda i: post(url, 2 * i), range(BOUND)))
    for r in results:
        check_completed(0, r)


def test_unbounded_by_default():
    assert engine_config_from_flat().server.max_waiting_requests is None
