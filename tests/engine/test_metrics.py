"""EngineMetrics on outputs built by hand, with the times set: the values each vLLM
series gets (phases, tokens, per-step tokens, n > 1, aborts, rejections)."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxllm.engine.output_processor import RequestMetrics
from jaxllm.metrics import EngineMetrics, build_1_2_5_buckets
from jaxllm.outputs import CompletionOutput, RequestOutput

PROMPT = [5, 6, 7]


def samples(metrics: EngineMetrics) -> dict:
    """{(sample name, labels without model_name/engine): value}."""
    out = {}
    text = generate_latest(metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "engine")))
            out[s.name, labels] = s.value
    return out


def output(tokens: list[list[int]], reasons: list, times: RequestMetrics,
           request_id: str = "r") -> RequestOutput:
    outs = [CompletionOutput(i, "", list(t), None, None, reason)
            for i, (t, reason) in enumerate(zip(tokens, reasons))]
    return RequestOutput(request_id, None, PROMPT, None, outs,
                         all(r is not None for r in reasons), metrics=times)


def step(metrics: EngineMetrics, out: RequestOutput, now: float) -> None:
    metrics.record_output(out, now)
    metrics.record_step()


def test_build_1_2_5_buckets_as_vllm():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(256) == [1, 2, 5, 10, 20, 50, 100, 200]
    assert build_1_2_5_buckets(4) == [1, 2]


def test_one_request_phases_and_tokens():
    m = EngineMetrics("tiny", 256)
    m.record_arrival("r", 100.0, 1, max_tokens=4)
    times = RequestMetrics(100.0, first_scheduled_time=100.5)
    for i, t in enumerate((101.0, 101.5, 102.5, 103.0)):   # a token a step
        times.first_token_time = times.first_token_time or t
        times.last_token_time = t
        step(m, output([list(range(i + 1))], [None if i < 3 else "length"], times),
             now=t + 0.25)
    s = samples(m)
    assert s["vllm:time_to_first_token_seconds_sum", ()] == pytest.approx(1.25)
    assert s["vllm:time_to_first_token_seconds_count", ()] == 1
    # Between the engine's step times: 0.5, 1.0, 0.5.
    assert s["vllm:inter_token_latency_seconds_count", ()] == 3
    assert s["vllm:inter_token_latency_seconds_sum", ()] == pytest.approx(2.0)
    assert s["vllm:inter_token_latency_seconds_bucket", (("le", "0.5"),)] == 2
    assert s["vllm:e2e_request_latency_seconds_sum", ()] == pytest.approx(3.25)
    assert s["vllm:request_queue_time_seconds_sum", ()] == pytest.approx(0.5)
    assert s["vllm:request_prefill_time_seconds_sum", ()] == pytest.approx(0.5)
    assert s["vllm:request_decode_time_seconds_sum", ()] == pytest.approx(2.0)
    assert s["vllm:request_inference_time_seconds_sum", ()] == pytest.approx(2.5)
    assert s["vllm:request_time_per_output_token_seconds_sum", ()] == pytest.approx(2.0 / 3)
    assert s["vllm:request_success_total", (("finished_reason", "length"),)] == 1
    assert s["vllm:request_success_total", (("finished_reason", "stop"),)] == 0
    assert s["vllm:prompt_tokens_total", ()] == 3
    assert s["vllm:generation_tokens_total", ()] == 4
    assert s["vllm:request_prompt_tokens_sum", ()] == 3
    assert s["vllm:request_generation_tokens_sum", ()] == 4
    assert s["vllm:request_generation_tokens_bucket", (("le", "5.0"),)] == 1
    assert s["vllm:request_generation_tokens_bucket", (("le", "2.0"),)] == 0
    assert s["vllm:request_params_max_tokens_sum", ()] == 4
    assert s["vllm:request_params_n_sum", ()] == 1
    assert s["vllm:request_max_num_generation_tokens_sum", ()] == 4
    # Steps: prompt + first token, then one token each.
    assert s["vllm:iteration_tokens_total_count", ()] == 4
    assert s["vllm:iteration_tokens_total_sum", ()] == 3 + 4
    assert s["vllm:iteration_tokens_total_bucket", (("le", "1.0"),)] == 3
    assert not m._timings


def test_n_samples_count_as_requests_and_params_once():
    m = EngineMetrics("tiny", 256)
    m.record_arrival("r", 10.0, 2, max_tokens=3)
    times = RequestMetrics(10.0, first_scheduled_time=11.0, first_token_time=12.0,
                           last_token_time=12.0)
    step(m, output([[1], [1]], [None, None], times), now=12.0)
    times.last_token_time = 13.0    # sample 1 stops at its second token
    step(m, output([[1, 2], [1, 2]], [None, "stop"], times), now=13.0)
    times.last_token_time = 15.0
    step(m, output([[1, 2, 3], [1, 2]], ["length", "stop"], times), now=15.0)
    s = samples(m)
    assert s["vllm:request_success_total", (("finished_reason", "stop"),)] == 1
    assert s["vllm:request_success_total", (("finished_reason", "length"),)] == 1
    assert s["vllm:time_to_first_token_seconds_count", ()] == 2
    assert s["vllm:prompt_tokens_total", ()] == 2 * len(PROMPT)
    assert s["vllm:generation_tokens_total", ()] == 5
    # Each sample's decode ends at its own last token: 13 - 12 and 15 - 12.
    assert s["vllm:request_decode_time_seconds_sum", ()] == pytest.approx(1.0 + 3.0)
    assert s["vllm:e2e_request_latency_seconds_sum", ()] == pytest.approx(3.0 + 5.0)
    assert s["vllm:request_generation_tokens_sum", ()] == 5
    assert s["vllm:request_params_max_tokens_count", ()] == 2
    assert s["vllm:request_params_n_count", ()] == 1
    assert s["vllm:request_params_n_sum", ()] == 2
    assert s["vllm:request_params_n_bucket", (("le", "1.0"),)] == 0
    assert s["vllm:request_max_num_generation_tokens_sum", ()] == 3
    assert s["vllm:iteration_tokens_total_sum", ()] == 2 * len(PROMPT) + 5


def test_abort_counts_unfinished_samples():
    m = EngineMetrics("tiny", 256)
    m.record_arrival("r", 0.0, 3)
    times = RequestMetrics(0.0, 0.1, 0.2, 0.2)
    step(m, output([[1], [1], [1]], [None, "stop", None], times), now=0.3)
    m.record_abort("r")
    m.record_abort("r")   # a second abort of the same request counts nothing
    s = samples(m)
    assert s["vllm:request_success_total", (("finished_reason", "abort"),)] == 2
    assert s["vllm:request_success_total", (("finished_reason", "stop"),)] == 1
    assert s["vllm:request_params_n_count", ()] == 0
    assert not m._timings


def test_outputs_without_engine_times_still_count():
    """An engine that hands back no RequestMetrics: TTFT, ITL and e2e on the server's
    clock; the phases, which need the engine's times, are not observed."""
    m = EngineMetrics("tiny", 256)
    m.record_arrival("r", 1.0, 1)
    step(m, output([[4]], [None], None), now=2.0)
    step(m, output([[4, 4]], ["stop"], None), now=2.5)
    s = samples(m)
    assert s["vllm:time_to_first_token_seconds_sum", ()] == pytest.approx(1.0)
    assert s["vllm:inter_token_latency_seconds_sum", ()] == pytest.approx(0.5)
    assert s["vllm:e2e_request_latency_seconds_sum", ()] == pytest.approx(1.5)
    assert s["vllm:request_prefill_time_seconds_count", ()] == 0
    assert s["vllm:request_params_max_tokens_count", ()] == 0   # max_tokens unknown


def test_outputs_of_unknown_requests_and_empty_steps_are_ignored():
    m = EngineMetrics("tiny", 256)
    m.record_output(output([[1]], ["stop"], None, request_id="never-added"), now=1.0)
    m.record_step()
    m.record_step()
    s = samples(m)
    assert s["vllm:iteration_tokens_total_count", ()] == 0
    assert s["vllm:request_success_total", (("finished_reason", "stop"),)] == 0


def test_record_rejected_counts_by_reason():
    m = EngineMetrics("tiny", 256)
    m.record_rejected("max_waiting_requests")
    m.record_rejected("max_waiting_requests")
    m.record_rejected("other")
    s = samples(m)
    assert s["jaxllm:request_rejected_total", (("reason", "max_waiting_requests"),)] == 2
    assert s["jaxllm:request_rejected_total", (("reason", "other"),)] == 1


def test_real_engine_with_preemptions(tiny_model):
    """The tiny Llama with too few KV blocks for its load: the engine preempts, and the
    per-request series still count every request and token once."""
    import asyncio

    from jaxllm.config import engine_config_from_flat
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.sampling_params import SamplingParams

    folder, _ = tiny_model("llama")
    config = engine_config_from_flat(
        model=folder, dtype="float32", max_model_len=128, max_num_seqs=8,
        max_num_batched_tokens=64, num_gpu_blocks_override=12, enforce_eager=True,
        preemption_mode="recompute")
    engine = AsyncLLM.from_config(config, multiprocess=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[(5 * i + j) % 200 + 3 for j in range(10 + 4 * i)] for i in range(8)]

    async def one(i):
        async for out in engine.generate(f"r{i}", {"prompt_token_ids": prompts[i]}, params):
            last = out
        return last

    async def run_all():
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    try:
        outs = asyncio.run(run_all())
    finally:
        engine.shutdown()
    s = samples(engine.metrics)
    assert s["vllm:num_preemptions_total", ()] > 0
    assert s["vllm:num_preemptions_total", ()] == engine.metrics.stats.num_preemptions_total
    assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 8
    assert s["vllm:request_success_total", (("finished_reason", "length"),)] == 8
    assert s["vllm:generation_tokens_total", ()] == 8 * 12
    assert s["vllm:prompt_tokens_total", ()] == sum(map(len, prompts))
    assert s["vllm:iteration_tokens_total_sum", ()] == 8 * 12 + sum(map(len, prompts))
    assert s["vllm:inter_token_latency_seconds_count", ()] == 8 * 11
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert s[f"vllm:{name}_count", ()] == 8, name
    assert s["vllm:request_inference_time_seconds_sum", ()] == pytest.approx(
        s["vllm:request_prefill_time_seconds_sum", ()]
        + s["vllm:request_decode_time_seconds_sum", ()], abs=1e-6)
    assert s["vllm:num_requests_running", ()] == s["vllm:num_requests_waiting", ()] == 0
