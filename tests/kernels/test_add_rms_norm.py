"""pallas_kernels/add_rms_norm.py: split-K partials summed into the residual stream and
RMS-normalized in one kernel, against its reference twin and against the model's own
ops (jnp sum, residual add, llama.RMSNorm), in interpret mode; its refusals; and its
lowering for CUDA at the Llama-3.1-8B shape."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from jaxllm.models.llama import RMSNorm
from pallas_kernels.add_rms_norm import fused_add_rms_norm, ref_fused_add_rms_norm

SD = jax.ShapeDtypeStruct


def _inputs(s, t, e, dtype, seed=0):
    rng = np.random.default_rng(seed)
    p = jnp.asarray(rng.standard_normal((s, t, e)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((t, e)) * 4, dtype)
    w = jnp.asarray(1 + 0.2 * rng.standard_normal(e), dtype)
    return p, r, w


@pytest.mark.parametrize("s,t,e", [(8, 16, 4096), (2, 3, 576), (1, 1, 64), (16, 5, 960)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_kernel_matches_reference_and_the_model_ops(s, t, e, dtype):
    """Rows of a power-of-two length and not (576, 960: masked lanes), one split and
    many: the reference's values exactly; the reference is the model's unfused ops."""
    p, r, w = _inputs(s, t, e, dtype)
    y, n = fused_add_rms_norm(p, r, w, eps=1e-5, interpret=True)
    ry, rn = ref_fused_add_rms_norm(p, r, w, eps=1e-5)
    assert y.dtype == n.dtype == dtype and y.shape == n.shape == (t, e)
    norm = RMSNorm(e, 1e-5, dtype)
    norm.weight.value = w
    my = r + p.sum(0).astype(dtype)
    np.testing.assert_array_equal(np.asarray(ry, np.float32), np.asarray(my, np.float32))
    np.testing.assert_allclose(np.asarray(rn, np.float32), np.asarray(norm(my), np.float32),
                               rtol=1e-6, atol=1e-6)
    # The kernel sums the splits in order, XLA's reduce in its own: f32 rows agree to
    # rounding, bf16 ones to within one bf16 step where a sum sits at a boundary.
    tol = dict(rtol=1e-6, atol=1e-5) if dtype == jnp.float32 else dict(rtol=8e-3, atol=0)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ry, np.float32), **tol)
    np.testing.assert_allclose(np.asarray(n, np.float32), np.asarray(rn, np.float32), **tol)


def test_rows_do_not_mix():
    """A row's output depends on its own partials and residual only."""
    p, r, w = _inputs(4, 6, 256, jnp.float32)
    y, n = fused_add_rms_norm(p, r, w, eps=1e-6, interpret=True)
    p2 = p.at[:, 3].set(1e3)
    y2, n2 = fused_add_rms_norm(p2, r, w, eps=1e-6, interpret=True)
    rows = [i for i in range(6) if i != 3]
    np.testing.assert_array_equal(np.asarray(y2)[rows], np.asarray(y)[rows])
    np.testing.assert_array_equal(np.asarray(n2)[rows], np.asarray(n)[rows])
    assert not np.array_equal(np.asarray(y2)[3], np.asarray(y)[3])


def test_refuses_what_it_does_not_take():
    p, r, w = _inputs(2, 3, 64, jnp.float32)
    with pytest.raises(ValueError, match=r"\[S <= 16, T, E <= 8192\], \[T, E\], \[E\]"):
        fused_add_rms_norm(p, r[:2], w, eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="S <= 16"):
        fused_add_rms_norm(jnp.zeros((17, 3, 64)), r, w, eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="E <= 8192"):
        fused_add_rms_norm(jnp.zeros((2, 1, 16384)), jnp.zeros((1, 16384)),
                           jnp.zeros(16384), eps=1e-5, interpret=True)


@pytest.mark.parametrize("t", [1, 16])
def test_lowers_for_cuda_at_the_8b_shape(t):
    text = lower_for_cuda(lambda p, r, w: fused_add_rms_norm(p, r, w, eps=1e-5),
                          SD((8, t, 4096), jnp.float32), SD((t, 4096), jnp.bfloat16),
                          SD((4096,), jnp.bfloat16))
    assert "fused_add_rms_norm" in text and "__gpu$xla.gpu.triton" in text
