"""/metrics as vLLM v1 exports it: the families its Grafana dashboard queries, with
vLLM's names, types, label names and bucket boundaries (written out here from
vllm/v1/metrics/loggers.py, not imported from jaxllm.metrics), and their values after
real requests to the tiny model's server."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MAX_MODEL_LEN, MODEL, scrape, wait_until_idle

TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
       10.0, 20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKENS = [1, 2, 5, 10, 20, 50, 100, 200]          # vLLM's 1-2-5 buckets up to 256
assert MAX_MODEL_LEN == 256
ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
COUNTERS = ["vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"]
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": TTFT,
    "vllm:inter_token_latency_seconds": ITL,
    "vllm:request_time_per_output_token_seconds": ITL,
    "vllm:e2e_request_latency_seconds": LATENCY,
    "vllm:request_queue_time_seconds": LATENCY,
    "vllm:request_inference_time_seconds": LATENCY,
    "vllm:request_prefill_time_seconds": LATENCY,
    "vllm:request_decode_time_seconds": LATENCY,
    "vllm:request_prompt_tokens": TOKENS,
    "vllm:request_generation_tokens": TOKENS,
    "vllm:request_max_num_generation_tokens": TOKENS,
    "vllm:request_params_max_tokens": TOKENS,
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:iteration_tokens_total": ITERATION,
}
# The series examples/observability/prometheus_grafana/grafana.json queries.
DASHBOARD = ["vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
             "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
             "vllm:generation_tokens_total", "vllm:inter_token_latency_seconds_bucket",
             "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
             "vllm:num_requests_running", "vllm:num_requests_waiting",
             "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
             "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc",
             "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
             "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
             "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
             "vllm:request_max_num_generation_tokens_sum"]
# What vLLM has no name for (jaxllm.metrics says why each is kept).
JAXLLM = {"jaxllm:kv_cache_free_blocks": "gauge", "jaxllm:kv_cache_total_blocks": "gauge",
          "jaxllm:structured_output_mask_seconds": "counter",
          "jaxllm:structured_output_compile_seconds": "counter",
          "jaxllm:structured_output_grammars_compiled": "counter",
          "jaxllm:request_rejected": "counter"}
BASE = {"model_name", "engine"}


@pytest.fixture
def families(server_url) -> dict:
    text = httpx.get(f"{server_url}/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def label_names(family, suffix: str = "") -> set[frozenset]:
    return {frozenset(s.labels) for s in family.samples if s.name == family.name + suffix}


def test_gauges_and_counters_as_vllm(families):
    for name in GAUGES:
        assert families[name].type == "gauge", name
        assert label_names(families[name]) == {frozenset(BASE)}, name
    for name in COUNTERS:
        assert families[name].type == "counter", name
        assert label_names(families[name], "_total") == {frozenset(BASE)}, name
    success = families["vllm:request_success"]
    assert success.type == "counter"
    assert label_names(success, "_total") == {frozenset(BASE | {"finished_reason"})}
    reasons = {s.labels["finished_reason"] for s in success.samples if s.name.endswith("_total")}
    assert {"stop", "length", "abort"} <= reasons
    sample = families["vllm:num_requests_running"].samples[0]
    assert sample.labels == {"model_name": MODEL, "engine": "0"}   # the first served name


@pytest.mark.parametrize("name", sorted(HISTOGRAMS))
def test_histograms_as_vllm(families, name):
    family = families[name]
    assert family.type == "histogram"
    assert label_names(family, "_bucket") == {frozenset(BASE | {"le"})}
    assert label_names(family, "_count") == label_names(family, "_sum") == {frozenset(BASE)}
    bounds = [float(s.labels["le"]) for s in family.samples if s.name == name + "_bucket"]
    assert bounds == [*map(float, HISTOGRAMS[name]), float("inf")]


def test_dashboard_series_and_no_other_jaxllm_names(families):
    sample_names = {s.name for f in families.values() for s in f.samples}
    assert not set(DASHBOARD) - sample_names
    ours = {name: f.type for name, f in families.items()
            if name.startswith("jaxllm:") and not name.endswith("_created")}
    assert ours == JAXLLM
    # The deprecated name vLLM hides by default is not exported.
    assert "vllm:time_per_output_token_seconds" not in families


def test_values_move_after_requests(client, server_url):
    before = scrape(server_url)
    one = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    two = client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=3, n=2,
                                    temperature=1, seed=3, extra_body={"ignore_eos": True})
    after = wait_until_idle(server_url)

    def delta(name, labels=()):
        return after[name].get(labels, 0) - before[name].get(labels, 0)

    p1, p2 = one.usage.prompt_tokens, two.usage.prompt_tokens
    assert [c.finish_reason for c in one.choices + two.choices] == ["length"] * 3
    # n=2 counts as two requests, as vLLM's child requests do.
    assert delta("vllm:request_success_total", (("finished_reason", "length"),)) == 3
    assert delta("vllm:prompt_tokens_total") == p1 + 2 * p2
    assert delta("vllm:generation_tokens_total") == 5 + 2 * 3
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_params_max_tokens"):
        assert delta(f"vllm:{name}_count") == 3, name
    # One inter-token latency per token after a completion's first.
    assert delta("vllm:inter_token_latency_seconds_count") == 4 + 2 + 2
    assert delta("vllm:request_prompt_tokens_sum") == p1 + 2 * p2
    assert delta("vllm:request_generation_tokens_sum") == 5 + 3 + 3
    assert delta("vllm:request_params_max_tokens_sum") == 5 + 3 + 3
    assert delta("vllm:request_params_n_count") == 2
    assert delta("vllm:request_params_n_sum") == 1 + 2
    assert delta("vllm:request_max_num_generation_tokens_sum") == 5 + 3
    # Tokens per step add up to the prompt and generation counters.
    assert delta("vllm:iteration_tokens_total_sum") == p1 + 2 * p2 + 11
    # inference = prefill + decode, request by request.
    assert delta("vllm:request_inference_time_seconds_sum") == pytest.approx(
        delta("vllm:request_prefill_time_seconds_sum")
        + delta("vllm:request_decode_time_seconds_sum"), abs=1e-6)
    # The +Inf bucket of a histogram holds its count.
    assert delta("vllm:request_generation_tokens_bucket", (("le", "+Inf"),)) == 3
    assert delta("vllm:request_generation_tokens_bucket", (("le", "2.0"),)) == 0
    assert delta("vllm:request_generation_tokens_bucket", (("le", "5.0"),)) == 3


def test_prefix_cache_counters_move(client, server_url):
    prompt = [(7 * i + 11) % 200 + 3 for i in range(20)]   # one full 16-token block
    seen = []
    for _ in range(2):
        before = scrape(server_url)
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        after = wait_until_idle(server_url)
        seen.append(tuple(after[n][()] - before[n][()] for n in
                          ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")))
    assert seen == [(20, 0), (20, 16)]


def test_rejected_counter_has_its_labels(server_url, async_engine):
    def rejected() -> dict:
        text = httpx.get(f"{server_url}/metrics", timeout=30).text
        family = {f.name: f for f in text_string_to_metric_families(text)}[
            "jaxllm:request_rejected"]
        return {tuple(sorted(s.labels.items())): s.value for s in family.samples
                if s.name == "jaxllm:request_rejected_total"}

    key = (("model_name", MODEL), ("reason", "max_waiting_requests"))
    before = rejected().get(key, 0)
    async_engine.metrics.record_rejected("max_waiting_requests")
    after = rejected()
    assert after[key] == before + 1
    assert {tuple(k for k, _ in labels) for labels in after} == {("model_name", "reason")}


def test_engine_process_outputs_carry_the_phase_times(server_config):
    """With the engine in its own process, the engine's times come over the wire
    with the deltas: every phase histogram is observed."""
    import asyncio

    from prometheus_client import generate_latest

    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.sampling_params import SamplingParams

    engine = AsyncLLM.from_config(server_config, multiprocess=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run():
        async for out in engine.generate("mp", "hello world", params):
            last = out
        return last

    try:
        out = asyncio.run(run())
    finally:
        engine.shutdown()
    text = generate_latest(engine.metrics.registry).decode()
    s = {x.name: x.value for f in text_string_to_metric_families(text) for x in f.samples
         if set(x.labels) == BASE}
    assert out.metrics.first_scheduled_time is not None
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert s[f"vllm:{name}_count"] == 1, name
    assert s["vllm:inter_token_latency_seconds_count"] == 3
    assert s["vllm:generation_tokens_total"] == 4
    assert s["vllm:prompt_tokens_total"] == len(out.prompt_token_ids)
