"""Concurrency, client disconnects and /metrics."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from server_helpers import MODEL, metric, scrape, wait_until_idle

PROMPTS = [f"the quick brown fox {word}" for word in
           ("jumps", "sea", "paris", "hello", "world", "waves", "dog", "seven")]
NUM_CLIENTS, NUM_LEAVING, MAX_TOKENS = 64, 16, 16
# A client that leaves asked for this many tokens: far more than it waits for, so its
# request can only end as an abort.
LEAVER_MAX_TOKENS = 240


async def _stream(client: openai.AsyncOpenAI, i: int, leave: bool) -> dict:
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], temperature=0, stream=True,
        max_tokens=LEAVER_MAX_TOKENS if leave else MAX_TOKENS,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            if leave and text:
                await stream.close()   # drop the connection mid-stream
                break
    return {"text": text, "finish": finish, "usage": usage}


async def _run_clients(url: str) -> list[dict]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                  timeout=300) as client:
        return await asyncio.gather(*(_stream(client, i, leave=i % 4 == 3)
                                      for i in range(NUM_CLIENTS)))


def test_concurrent_streams_with_disconnects(client, server_url):
    expected = [client.completions.create(model=MODEL, prompt=p, temperature=0,
                                          max_tokens=MAX_TOKENS,
                                          extra_body={"ignore_eos": True}).choices[0].text
                for p in PROMPTS]
    aborted_before = metric(server_url, "vllm:request_success_total", finished_reason="abort")
    results = asyncio.run(_run_clients(server_url))
    for i, result in enumerate(results):
        if i % 4 == 3:
            assert result["finish"] is None and result["text"]   # left mid-stream
            continue
        assert result["finish"] == "length"
        assert result["text"] == expected[i % len(PROMPTS)], i
        assert result["usage"].completion_tokens == MAX_TOKENS
    m = wait_until_idle(server_url, timeout=20)
    assert m["vllm:num_requests_running"][()] == 0
    assert m["vllm:num_requests_waiting"][()] == 0
    assert m["vllm:kv_cache_usage_perc"][()] == 0
    assert m["jaxllm:kv_cache_free_blocks"][()] == m["jaxllm:kv_cache_total_blocks"][()] > 0
    aborted = m["vllm:request_success_total"][(("finished_reason", "abort"),)]
    assert aborted - aborted_before == NUM_LEAVING


def test_non_streaming_disconnect_aborts(server_url):
    aborted_before = metric(server_url, "vllm:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):   # 240 decode steps take 0.1-1 s on 2 CPU cores
        httpx.post(f"{server_url}/v1/completions", timeout=0.06, json={
            "model": MODEL, "prompt": "hello", "max_tokens": LEAVER_MAX_TOKENS,
            "temperature": 0, "ignore_eos": True})
    m = wait_until_idle(server_url, timeout=10)
    assert m["vllm:num_requests_running"][()] == 0
    assert m["jaxllm:kv_cache_free_blocks"][()] == m["jaxllm:kv_cache_total_blocks"][()]
    assert metric(server_url, "vllm:request_success_total",
                  finished_reason="abort") == aborted_before + 1


def test_metrics_parse_and_move(client, server_url):
    before = scrape(server_url)
    names = {"vllm:num_requests_running", "vllm:num_requests_waiting",
             "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
             "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:request_success_total", "vllm:prefix_cache_queries_total",
             "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_count",
             "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
             "vllm:request_queue_time_seconds_count"}
    assert names <= set(before)
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    after = wait_until_idle(server_url)

    def delta(name, labels=()):
        return after[name].get(labels, 0) - before[name].get(labels, 0)

    assert delta("vllm:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:request_success_total", (("finished_reason", "length"),)) == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert delta(f"vllm:{hist}_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") >= 1
