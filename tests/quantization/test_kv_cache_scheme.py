"""compressed-tensors checkpoints with a kv_cache_scheme (what llm-compressor writes for
an fp8 KV cache): each layer's self_attn.k_scale / v_scale (or older llm-compressor's
k_proj / v_proj output_scale) are read and checked up front; as in vLLM the cache is
then fp8 (e4m3) under `auto` as under `fp8`, and fp8_e5m2 is refused. The pool stores
keys and values divided by the largest layer's scales (kv_cache.spec_kv_scales: the
kernels' scales are compile-time constants). The checkpoint: a tiny Llama FP8_DYNAMIC
packed by the compressed-tensors package, its config and tensors given the scheme and
the scales."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import quant_util as qu
from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError
from jaxllm.entrypoints.cli import main

ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              enforce_eager=True, cpu_kv_cache_bytes=1 << 20)
SCALES = ((0.02, 0.04), (0.08, 0.01))      # (k_scale, v_scale) of layers 0 and 1
PROMPT = {"prompt_token_ids": [3, 17, 5, 9, 12, 7, 1, 30]}


def _scheme(cfg):
    cfg["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
        "symmetric": True, "group_size": None, "observer": "minmax"}


def _scales(names):
    def edit(t):
        for i, (k, v) in enumerate(SCALES):
            t[names.format(i=i, kv="k")] = torch.tensor(k)
            t[names.format(i=i, kv="v")] = torch.tensor([v])
    return edit


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ct-fp8"))
    qu.write_compressed_tensors(folder, qu.make_model(folder, "llama"), "FP8_DYNAMIC")
    return folder


@pytest.fixture(scope="module")
def folder(base, tmp_path_factory):
    return qu.edited_copy(base, tmp_path_factory.mktemp("kv") / "ckpt", _scheme,
                          _scales("model.layers.{i}.self_attn.{kv}_scale"))


def _pool_after_one_prompt(llm):
    """Every layer's (k, v) pool in f32 after the prompt's prefill (the one token it
    samples is not written), and that token's top logprobs."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=5,
                                                ignore_eos=True), use_tqdm=False)
    pools = [[np.asarray(x).astype(np.float32) for x in kv]
             for kv in llm.llm_engine.runner.kv_caches]
    return pools, out[0].outputs[0].logprobs[0]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_fp8_pool_stores_keys_and_values_divided_by_the_scales(base, folder, kv_cache_dtype):
    llm = LLM(folder, kv_cache_dtype=kv_cache_dtype, **ENGINE)
    spec = llm.llm_engine.runner.spec
    assert str(llm.llm_engine.runner.kv_caches[0][0].dtype) == "float8_e4m3fn"
    np.testing.assert_allclose((spec.k_scale, spec.v_scale), (0.08, 0.04), rtol=1e-6)
    stored, lps = _pool_after_one_prompt(llm)
    exact, ref_lps = _pool_after_one_prompt(LLM(base, **ENGINE))   # float pool, same slots
    scales = (spec.k_scale, spec.v_scale)
    for layer in range(len(SCALES)):
        for x, ref, scale in zip(stored[layer], exact[layer], scales):
            assert np.abs(ref).max() > 0.1
            if layer == 0:   # the same keys and values, rounded to e4m3 after the scale
                np.testing.assert_array_less(np.abs(x * scale - ref),
                                             np.abs(ref) / 16 + scale / 2 ** 9 + 1e-7)
            else:            # its inputs moved too, with layer 0's fp8 keys and values
                err = np.linalg.norm(x * scale - ref) / np.linalg.norm(ref)
                assert err < 0.1, (layer, err)
    # The read side multiplies back: the last layer's output, the logits, stay close.
    top = max(ref_lps, key=lambda t: ref_lps[t].logprob)
    assert top in lps and abs(lps[top].logprob - ref_lps[top].logprob) < 0.5


def test_older_output_scale_names(base, tmp_path):
    old = qu.edited_copy(base, tmp_path / "ckpt", _scheme,
                         _scales("model.layers.{i}.self_attn.{kv}_proj.output_scale"))
    spec = LLM(old, **ENGINE).llm_engine.runner.spec
    np.testing.assert_allclose((spec.k_scale, spec.v_scale), (0.08, 0.04), rtol=1e-6)


def test_e5m2_cache_refused(folder, capsys):
    with pytest.raises(ConfigError, match="kv_cache_dtype=fp8_e5m2: .* stores fp8 KV scales "
                                          r"\(kv_cache_scheme\) for an e4m3 cache; use fp8 "
                                          "or auto"):
        LLM(folder, kv_cache_dtype="fp8_e5m2", **ENGINE)
    with pytest.raises(SystemExit) as e:          # the launcher's check, before loading
        main(["generate", folder, "--kv-cache-dtype", "fp8_e5m2", "--prompt", "hi",
              "--compilation-cache-dir", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "kv_cache_dtype=fp8_e5m2" in err[0], err


def test_random_weights_run_the_fp8_cache_too(folder):
    """--load-format dummy of such a checkpoint: the fp8 cache its real weights run
    (scales of 1), and fp8_e5m2 refused as with them."""
    llm = LLM(folder, load_format="dummy", **ENGINE)
    assert str(llm.llm_engine.runner.kv_caches[0][0].dtype) == "float8_e4m3fn"
    assert (llm.llm_engine.runner.spec.k_scale, llm.llm_engine.runner.spec.v_scale) == (1, 1)
    with pytest.raises(ConfigError, match="kv_cache_dtype=fp8_e5m2"):
        LLM(folder, load_format="dummy", kv_cache_dtype="fp8_e5m2", **ENGINE)


@pytest.mark.parametrize("kv_cache_dtype, scaled", [("auto", False), ("fp8", True),
                                                    ("fp8_e4m3", True), ("fp8_e5m2", False)])
def test_scales_reach_the_spec_only_with_an_e4m3_pool(kv_cache_dtype, scaled):
    """A model whose own checkpoint has KV scales behind another's cache config (a
    draft model shares its target's): the kernels scale what they read whatever the
    pool, so a float or e5m2 pool, which no write divided, must keep scales of 1."""
    from jaxllm.config import CacheConfig
    from jaxllm.runner.kv_cache import spec_kv_scales
    got = spec_kv_scales(SCALES, CacheConfig(kv_cache_dtype=kv_cache_dtype))
    assert got == (dict(k_scale=0.08, v_scale=0.04) if scaled else {})
