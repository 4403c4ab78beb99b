"""Ragged paged attention kernel (interpret mode) against its reference."""
from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from kernel_cases import E5M2, FP8, assert_close, make_case, run
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ref_ragged_paged_attention)

# Mixed batches: chunked prefill with a cached prefix, a full prompt, decode tokens (q 1),
# an idle row (q 0), a padding row (kv 0); lengths from 1 to several blocks, partial
# last blocks; padding tokens after query_start_loc[-1].
MIXED = dict(q_lens=[21, 1, 40, 0, 1, 0], kv_lens=[53, 17, 40, 9, 1, 0], pad_tokens=5)
CASES = {
    # name: (case kwargs, kernel settings)
    "g1_d64_bs16": (dict(hq=2, hkv=2, d=64, bs=16, **MIXED), dict(block_q=16, blocks_per_step=2)),
    "g4_d128_bs32": (dict(hq=8, hkv=2, d=128, bs=32, **MIXED), dict(block_q=8, blocks_per_step=1)),
    "g8_d64_fp8": (dict(hq=8, hkv=1, d=64, bs=16, kv_dtype=FP8, scale=0.5, **MIXED),
                   dict(block_q=4, blocks_per_step=2)),
    "g4_d64_e5m2": (dict(hq=8, hkv=2, d=64, bs=16, kv_dtype=E5M2, **MIXED),
                    dict(block_q=4, blocks_per_step=2)),
    "g3_d80_pad": (dict(hq=6, hkv=2, d=80, bs=16, **MIXED), dict(block_q=8, blocks_per_step=1)),
    "defaults": (dict(hq=8, hkv=2, d=64, bs=16, **MIXED), dict()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    case_kw, settings = CASES[name]
    scale = case_kw.get("scale", 1.0)
    c = make_case(0, **case_kw)
    kw = dict(sm_scale=0.3, k_scale=scale, v_scale=scale)
    out = run(functools.partial(ragged_paged_attention, interpret=True, **kw, **settings),
              *c.attn_args)
    assert_close(out, ref_ragged_paged_attention(*c.attn_args, **kw))
    assert (out[int(c.query_start_loc[-1]):] == 0).all()   # padding tokens


def test_sliding_window():
    c = make_case(1, hq=4, hkv=2, d=64, bs=16, **MIXED)
    kw = dict(sm_scale=0.3, sliding_window=19)
    out = run(functools.partial(ragged_paged_attention, interpret=True, block_q=8,
                                blocks_per_step=1, **kw), *c.attn_args)
    assert_close(out, ref_ragged_paged_attention(*c.attn_args, **kw))


def test_bfloat16():
    c = make_case(2, hq=8, hkv=2, d=64, bs=16, dtype=jnp.bfloat16, **MIXED)
    out = run(functools.partial(ragged_paged_attention, sm_scale=0.3, interpret=True,
                                block_q=8), *c.attn_args)
    assert_close(out, ref_ragged_paged_attention(*c.attn_args, sm_scale=0.3), rtol=2e-2)
