"""compressed-tensors checkpoints with a kv_cache_scheme (what llm-compressor writes for
an fp8 KV cache): each layer's self_attn.k_scale / v_scale are read, and with
--kv-cache-dtype fp8 the pool stores that layer's keys and values divided by them (as
vLLM's); with a float pool they go unused. The checkpoint: a tiny Llama FP8_DYNAMIC
packed by the compressed-tensors package, its config and tensors given the scheme and
the scales (distinct per layer and per k / v, so a scale taken from the wrong layer or
not applied shows)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import quant_util as qu
from jaxllm import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              enforce_eager=True, cpu_kv_cache_bytes=1 << 20)
SCALES = ((0.02, 0.04), (0.08, 0.16))      # (k_scale, v_scale) of layers 0 and 1


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("ct-fp8"))
    qu.write_compressed_tensors(base, qu.make_model(base, "llama"), "FP8_DYNAMIC")

    def scheme(cfg):
        cfg["quantization_config"]["kv_cache_scheme"] = {
            "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
            "symmetric": True, "group_size": None, "observer": "minmax"}

    def scales(t):
        for i, (k, v) in enumerate(SCALES):
            t[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
            t[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v])
    return qu.edited_copy(base, tmp_path_factory.mktemp("kv") / "ckpt", scheme, scales)


def _pool_after_one_prompt(llm):
    llm.generate([{"prompt_token_ids": [3, 17, 5, 9, 12, 7, 1, 30]}],
                 SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return [[np.asarray(x).astype(np.float32) for x in kv]
            for kv in llm.llm_engine.runner.kv_caches]


def test_fp8_pool_stores_each_layer_divided_by_its_scales(folder):
    fp8 = LLM(folder, kv_cache_dtype="fp8", **ENGINE)
    np.testing.assert_allclose(fp8.llm_engine.runner.spec.layer_kv_scales, SCALES,
                               rtol=1e-6)       # the checkpoint's f32 values
    assert str(fp8.llm_engine.runner.kv_caches[0][0].dtype) == "float8_e4m3fn"
    stored = _pool_after_one_prompt(fp8)
    exact = _pool_after_one_prompt(LLM(folder, **ENGINE))       # a float pool, same slots
    for layer, scales in enumerate(SCALES):
        for x, ref, scale in zip(stored[layer], exact[layer], scales):
            assert np.abs(ref).max() > 0.1
            if layer == 0:   # the same keys and values, rounded to e4m3 after the scale
                np.testing.assert_array_less(np.abs(x * scale - ref),
                                             np.abs(ref) / 16 + scale / 2 ** 9 + 1e-7)
            else:            # its inputs moved too, with layer 0's fp8 keys and values
                err = np.linalg.norm(x * scale - ref) / np.linalg.norm(ref)
                assert err < 0.1, (layer, err)


def test_float_pool_leaves_the_scales_unused(folder, caplog):
    with caplog.at_level(logging.INFO, logger="jaxllm.runner.kv_cache"):
        llm = LLM(folder, **ENGINE)
    assert llm.llm_engine.runner.spec.layer_kv_scales is None
    assert llm.llm_engine.runner.spec.k_scale == 1.0
    assert any("fp8 KV-cache scales are unused with kv_cache_dtype=auto" in r.getMessage()
               for r in caplog.records)
