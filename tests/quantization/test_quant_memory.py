"""Memory accounting of quantized weights: the KV pool is sized after the quantized
weights' bytes, and the start-up report says what the float weights would have taken
and how many KV blocks the bytes the quantized ones save hold. Tiny Llama with dummy
weights on the CPU, a GPU's byte limit faked (the pool then comes from the compiled
step's peak, as on a GPU)."""
from __future__ import annotations

import logging

import pytest

from jaxllm import LLM
from jaxllm.runner import kv_cache
from jaxllm.runner.model_runner import ModelRunner

ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              enforce_eager=True, load_format="dummy", gpu_memory_utilization=0.5)


def _report(folder, quantization, caplog):
    with caplog.at_level(logging.INFO, logger="jaxllm.runner.model_runner"):
        runner = LLM(folder, quantization=quantization, **ENGINE).llm_engine.runner
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    caplog.clear()
    return runner, lines[-1]


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantized_weights_gain_kv_blocks(tiny_model, monkeypatch, caplog, kind):
    folder, _ = tiny_model("llama")
    limit = [64 << 20]
    monkeypatch.setattr(ModelRunner, "device_limit", lambda self: limit[0])
    monkeypatch.setattr(kv_cache, "HEADROOM", 0)
    f = _report(folder, None, caplog)[0].initialize_kv_cache()
    # A budget of a few dozen float blocks beside the float step's peak: few enough
    # that their count is not rounded (stable_block_count), so every block shows.
    limit[0] = int((f.weights + f.activations + 40 * f.per_block) / ENGINE[
        "gpu_memory_utilization"])
    float_runner, float_line = _report(folder, None, caplog)
    runner, line = _report(folder, kind, caplog)
    f, q = float_runner.initialize_kv_cache(), runner.initialize_kv_cache()
    assert f.unquantized_extra == 0 and f.blocks_gained == 0
    assert q.weights + q.unquantized_extra == f.weights and q.unquantized_extra > 0
    assert q.blocks_gained == q.unquantized_extra // q.per_block > 0
    assert q.num_blocks > f.num_blocks
    assert f"blocks available {q.num_blocks} (the quantized weights' savings hold " \
           f"{q.blocks_gained})" in line
    assert "unquantized" not in float_line and "savings" not in float_line
