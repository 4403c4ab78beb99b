"""Quantized models under tensor parallelism on 8 CPU devices: TP = 2, 4, 8 against
TP = 1 through the real engine, and every quantized weight sharded like its scales.

Not collected on its own: test_quant_tp.py runs it in a child process whose XLA_FLAGS
give it 8 host devices.
"""
from __future__ import annotations

import os

import pytest

if "device_count=8" not in os.environ.get("XLA_FLAGS", ""):
    pytest.skip("needs 8 host devices (run through test_quant_tp.py)", allow_module_level=True)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import int_checkpoints as ic  # noqa: E402
import quant_util as qu  # noqa: E402
from jaxllm import LLM  # noqa: E402
from tp_util import ENGINE, TP_MODELS, generate_greedy  # noqa: E402

# case -> (arch, how: an online --quantization or a checkpoint writer, TPs)
CASES = {
    "llama-online-fp8": ("llama", "fp8", [2, 4, 8]),
    "qwen3-online-int8": ("qwen3", "int8", [2, 4, 8]),
    "llama-ct-w8a8": ("llama", "W8A8", [2, 4, 8]),
    "qwen3-ct-fp8-static": ("qwen3", "FP8", [2, 8]),
    "llama-native-fp8-block": ("llama", "native", [2]),
    "qwen3-gptq-desc-act": ("qwen3", "gptq", [2]),
    # TP_MODELS shapes in groups of 32 (down_proj's 112 inputs: a short last group);
    # at TP = 4 q_proj and kv_proj stay apart
    "llama-awq": ("llama", "awq", [2, 4]),
    # compressed-tensors W4A16 (groups of 128, so widths of 128 and 256): at TP = 2
    # o_proj's one group stays whole, at TP = 8 down_proj's two too
    "qwen3-ct-w4a16": ("qwen3", "W4A16", [2, 8]),
}
WIDTHS = {"qwen3-ct-w4a16": dict(hidden_size=128, intermediate_size=256)}
GROUP = {"gptq": 32, "awq": 32}     # K per scale of the grouped formats; else 128


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folders, runs = {}, {}

    def get(case: str, tp: int):
        arch, how, _ = CASES[case]
        if case not in folders:
            folder = str(tmp_path_factory.mktemp(case))
            if how == "native":
                qu.write_native_fp8(folder, qu.make_model(folder, arch, num_hidden_layers=1,
                                                          **qu.BLOCK_SHAPES))
            elif how == "gptq":
                ic.write_gptq_or_awq(folder, qu.make_model(folder, arch, num_hidden_layers=1,
                                                           **qu.BLOCK_SHAPES),
                                     "gptq", bits=4, group=32, desc_act=True)
            else:
                overrides, vocab = TP_MODELS[arch]
                model = qu.make_model(folder, arch, vocab_size=vocab, **overrides,
                                      **WIDTHS.get(case, {}))
                if how == "awq":
                    ic.write_gptq_or_awq(folder, model, "awq", group=32, sym=False)
                elif how in ("fp8", "int8"):
                    model.save_pretrained(folder)
                    qu.shared().build_tokenizer(folder, vocab)
                else:
                    qu.write_compressed_tensors(folder, model, how)
            folders[case] = folder
        if (case, tp) not in runs:
            q = how if how in ("fp8", "int8") else None
            llm = LLM(folders[case], tensor_parallel_size=tp, quantization=q, **ENGINE)
            runs[case, tp] = (llm, *generate_greedy(llm))
        return runs[case, tp]
    get.folders = folders
    return get


PAIRS = [(c, tp) for c, (_, _, tps) in CASES.items() for tp in tps]


@pytest.mark.parametrize("case,tp", PAIRS)
def test_greedy_and_logits_match_tp1(run, case, tp):
    _, ref_tokens, ref_logits = run(case, 1)
    llm, tokens, logits = run(case, tp)
    assert tokens == ref_tokens
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        # Shard-wise partial sums round differently, and a rounding step of one
        # quantized activation is the larger term: looser than float TP's 1e-5.
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-2, err_msg=f"step {step}")


@pytest.mark.parametrize("case,tp", PAIRS)
def test_weights_and_scales_shard_alike(run, case, tp):
    llm = run(case, tp)[0]
    arch = llm.llm_engine.runner.arch
    state = dict(nnx.to_flat_state(llm.llm_engine.runner.state))
    fused = arch.num_kv_heads % tp == 0
    how = CASES[case][1]
    block = how in ("native", "gptq", "awq", "W4A16")    # scales per row and K-group
    grouped = how in ("gptq", "awq", "W4A16")            # with zero points
    # o_proj's and down_proj's block / group scales: one per 128 (GPTQ and AWQ here: 32)
    # of their inputs, split when tp divides them
    size = GROUP.get(how, 128)

    def split_groups(k):
        return "tp" if -(-k // size) % tp == 0 else None
    o_groups = split_groups(arch.num_heads * arch.head_dim)
    d_groups = split_groups(arch.intermediate_size)
    want = {   # (weight spec, scale spec): each scale split like its weight's output rows
        # q and k/v are one qkv_proj, its rows grouped by KV head, split by KV head;
        # with fewer KV heads than devices they stay apart, q split by query head
        "qkv_proj": (P("tp", None, None, None),
                     P("tp", None, None, None) if block else P("tp", None, None)),
        "q_proj": (P("tp", None, None), P("tp", None, None) if block else P("tp", None)),
        "kv_proj": (P(None, None, None, None),
                    P(None, None, None, None) if block else P(None, None, None)),
        "o_proj": (P(None, "tp", None), P(None, o_groups) if block else P(None)),
        "gate_up_proj": (P(None, "tp", None), P(None, "tp", None) if block else P(None, "tp")),
        "down_proj": (P(None, "tp"), P(None, d_groups) if block else P(None)),
    }
    seen, names = 0, set()
    for path, var in state.items():
        if path[-1] not in ("weight", "weight_scale", "weight_zero_point") \
                or path[-2] not in want:
            continue
        spec = var.get_value().sharding.spec
        expect = want[path[-2]][path[-1] != "weight"]     # zeros split like scales
        assert tuple(spec) + (None,) * (len(expect) - len(spec)) == tuple(expect), (path, spec)
        seen, names = seen + 1, names | {path[-2]}
    assert ("qkv_proj" in names) == fused and ("q_proj" in names) == (not fused)
    projections = 4 if fused else 5
    assert seen == (3 if grouped else 2) * projections * arch.num_layers


@pytest.mark.parametrize("tp", [2, 4])
def test_kv_report_counts_the_float_weights_per_device(run, tp):
    """The KV report's unquantized_extra: the bytes the float model's weights would
    take on one device beyond the quantized ones, each leaf sharded as the loader
    shards it (at TP = 4 the tiny Llama's k/v are replicated, not split)."""
    from jaxllm.runner import kv_cache
    q = run("llama-online-fp8", tp)[0].llm_engine.runner
    f = LLM(run.folders["llama-online-fp8"], tensor_parallel_size=tp,
            **ENGINE).llm_engine.runner
    extra = kv_cache.unquantized_extra(q.quant, q.arch, q.model_dtype, q.state, q.mesh)
    assert extra > 0
    assert kv_cache.device_bytes(q.params) + extra == kv_cache.device_bytes(f.params)
