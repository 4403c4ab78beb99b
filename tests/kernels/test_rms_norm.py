"""RMSNorm and fused residual-add + RMSNorm kernels (interpret mode) against their twins."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import assert_close, same_bits
from pallas_kernels.rms_norm import (fused_add_rms_norm, ref_fused_add_rms_norm, ref_rms_norm,
                                     rms_norm)


def _inputs(rows, e, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, e)) * 3, dtype)
    res = jnp.asarray(rng.standard_normal((rows, e)), dtype)
    w = jnp.asarray(rng.standard_normal(e) + 1, dtype)
    return x, res, w


# E a power of two, and not (SmolLM2's 576: padded columns must not count in the mean);
# rows not a multiple of rows_per_program.
@pytest.mark.parametrize("rows,e,rpp", [(5, 128, 1), (7, 576, 4), (3, 96, 2)])
def test_fused_add_rms_norm_float32(rows, e, rpp):
    x, res, w = _inputs(rows, e, jnp.float32)
    want_out, want_res = ref_fused_add_rms_norm(x, res, w, 1e-5)
    out, new_res = fused_add_rms_norm(x, res, w, 1e-5, rows_per_program=rpp, interpret=True)
    assert_close(out, want_out)
    assert same_bits(new_res, want_res)      # the residual stream is exact
    assert_close(rms_norm(x, w, 1e-5, rows_per_program=rpp, interpret=True),
                 ref_rms_norm(x, w, 1e-5))


def test_fused_add_rms_norm_bfloat16_rounds_the_sum_like_the_unfused_add():
    x, res, w = _inputs(6, 256, jnp.bfloat16, seed=1)
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6, interpret=True)
    assert new_res.dtype == out.dtype == jnp.bfloat16
    assert same_bits(new_res, x + res)
    want = ref_rms_norm(x + res, w, 1e-6)
    assert_close(out.astype(jnp.float32), want.astype(jnp.float32), rtol=1e-2)


def test_reference_matches_a_plain_rms_norm():
    x, _, w = _inputs(4, 64, jnp.float32, seed=2)
    xn = np.asarray(x, np.float64)
    want = xn / np.sqrt((xn ** 2).mean(-1, keepdims=True) + 1e-5) * np.asarray(w)
    assert_close(ref_rms_norm(x, w, 1e-5), want)
