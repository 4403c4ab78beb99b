"""The Mosaic GPU weight-only FP8 kernel (pallas_kernels/w8a16_mgpu.py): its plain-jnp
twin against the layer's XLA path, the kernel in GPU interpret mode against the twin,
its refusals and default splits, and its lowering for CUDA (Mosaic's layout inference
runs there, on this CPU)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from jaxllm.layers.quantization import linear
from pallas_kernels import w8a16_mgpu as w8

SD = jax.ShapeDtypeStruct


def _args(m, n, k, seed=0, x_dtype=jnp.bfloat16):
    """x, an e4m3 weight spread over its range (subnormals to 448) and channel scales."""
    kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(x_dtype)
    wq = (jax.random.normal(kw, (n, k), jnp.float32) * 60).astype(jnp.float8_e4m3fn)
    scale = jax.random.uniform(ks, (n,), jnp.float32, 1e-3, 4e-3)
    return x, wq, scale


def test_twin_is_the_layers_weight_only_product():
    """The twin computes what weight_only_matmul does (x as f16, the weight widened
    exactly, the scale on the f32 product); a weight read as raw bytes would not."""
    x, wq, s = _args(5, 256, 512)
    want = linear.weight_only_matmul(x, wq, s, 1)
    got = w8.ref_w8a16_matmul(x, wq, s, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                               atol=1e-5 * float(jnp.max(jnp.abs(want))))
    raw = jax.lax.bitcast_convert_type(wq, jnp.int8).astype(jnp.float32)
    wrong = jnp.einsum("mk,nk->mn", x.astype(jnp.float32), raw) * s
    assert float(jnp.max(jnp.abs(wrong - want))) > 0.1 * float(jnp.max(jnp.abs(want)))


@pytest.mark.parametrize("m,n,k,settings", [
    (1, 128, 512, {}),
    (5, 256, 1024, dict(k_splits=2)),
    (16, 128, 1024, dict(k_splits=2, tile_n=64)),
    (33, 256, 1024, dict(stages=2)),
    (64, 128, 1536, dict(k_splits=3)),
    (3, 128, 1024, dict(cols=256, k_splits=2)),       # two sub-steps a pipeline step
    (16, 256, 2048, dict(cols=512, k_splits=1, stages=2)),
    (7, 128, 1024, dict(k_splits=2, out_rows=False)),
], ids=str)
def test_kernel_matches_twin_interpret(m, n, k, settings):
    args = _args(m, n, k, seed=m)
    got = w8.w8a16_matmul(*args, out_dtype=jnp.float32, interpret=True, **settings)
    want = w8.ref_w8a16_matmul(*args, out_dtype=jnp.float32)
    assert got.shape == (m, n)
    # the same f16 operands; only the order of the f32 sums differs. The interpreter
    # fills x's tile rows past M with NaNs: none leaks into a row of the output.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_scalar_scale_and_f16_input_interpret():
    """A per-tensor scale (a scalar) and an f16 input take the same kernel."""
    x, wq, _ = _args(4, 128, 512, seed=3, x_dtype=jnp.float16)
    s = jnp.float32(0.0025)
    got = w8.w8a16_matmul(x, wq, s, interpret=True)
    assert got.dtype == jnp.float16
    want = w8.ref_w8a16_matmul(x, wq, s, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want),
                               rtol=2e-3, atol=2e-3 * float(jnp.max(jnp.abs(want))))


def test_bad_operands_are_refused():
    x, wq, s = _args(4, 128, 512)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w8.w8a16_matmul(x, wq.astype(jnp.bfloat16), s)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w8.w8a16_matmul(x, wq.T, s)
    with pytest.raises(ValueError, match="M 65 > 64"):
        w8.w8a16_matmul(_args(65, 128, 512)[0], wq, s)
    with pytest.raises(ValueError, match="K 640 not a multiple of 128|N 128"):
        w8.w8a16_matmul(*_args(4, 128, 640)[:2], s, k_splits=1, tile_n=256)
    with pytest.raises(ValueError, match="k_splits 3: K 512"):
        w8.w8a16_matmul(x, wq, s, k_splits=3)
    with pytest.raises(ValueError, match="cols 192: a multiple of 128"):
        w8.w8a16_matmul(x, wq, s, cols=192)
    with pytest.raises(ValueError, match="shared memory"):
        w8.w8a16_matmul(x, wq, s, k_splits=1, stages=16, cols=512)
    with pytest.raises(ValueError, match="warpgroups 3: 1 or 2"):
        w8.w8a16_matmul(x, wq, s, warpgroups=3)
    # the warp-specialized program has no interpret mode (its GPU runs check it)
    with pytest.raises(ValueError, match="warpgroups 2: jax >= 0.11 on a GPU"):
        w8.w8a16_matmul(x, wq, s, warpgroups=2, interpret=True)


def test_default_splits():
    """The 8B projections: programs at least twice the 132 SMs where a split keeps 4
    sub-steps, within shared memory at 64 rows with two programs an SM."""
    got = {(n, k): w8.default_k_splits(n, k, 128)
           for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]}
    assert got == {(6144, 4096): 8, (4096, 4096): 8, (28672, 4096): 2, (4096, 14336): 14}
    for (n, k), s in got.items():
        assert (k // w8.B) % s == 0 and k // w8.B // s >= 4
        assert n // 128 * s >= 2 * 132 or k // w8.B // s == 4     # o: the most there are
        assert w8.supported(n, k)
    for mp in (16, 32, 64):
        assert 2 * (w8.smem_bytes(128, mp, w8.default_stages(mp)) + 1024) <= 228 * 1024
    assert not w8.supported(4096, 128 * 3)       # no split of 4 sub-steps
    assert not w8.supported(4096 + 64, 4096)     # N off the 128 tiles


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_lowers_for_cuda(m, n, k):
    """Every Llama-3.1-8B projection at decode sizes: the 8-bit tile's load, relayout and
    widening pass Mosaic's layout inference for the GPU."""
    text = lower_for_cuda(w8.w8a16_matmul, SD((m, k), jnp.bfloat16),
                          SD((n, k), jnp.float8_e4m3fn), SD((n,), jnp.float32))
    assert "mosaic_gpu" in text
    assert "stablehlo.pad" not in text                # x's tiles read past M, no pad


@pytest.mark.parametrize("settings", [dict(cols=256), dict(cols=512, stages=2),
                                      dict(k_splits=4, stages=6), dict(tile_n=64),
                                      dict(warpgroups=2), dict(warpgroups=2, k_splits=8)],
                         ids=str)
def test_settings_lower_for_cuda(settings):
    """Each setting lowers for the GPU; the warp-specialized program only on jax >= 0.11
    (refused before, in one line)."""
    args = (SD((16, 4096), jnp.float16), SD((28672, 4096), jnp.float8_e4m3fn),
            SD((28672,), jnp.float32))
    fn = functools.partial(w8.w8a16_matmul, **settings)
    if settings.get("warpgroups") == 2 and not w8.ROWS:
        with pytest.raises(ValueError, match="warpgroups 2: jax >= 0.11"):
            lower_for_cuda(fn, *args)
        return
    assert "mosaic_gpu" in lower_for_cuda(fn, *args)


def test_call_sites_share_one_trace(monkeypatch):
    """Identical calls (a model's layers) share one trace, so one lowering."""
    traced = []
    real = w8._call
    monkeypatch.setattr(w8, "_call", lambda *a, **kw: traced.append(1) or real(*a, **kw))
    w8.w8a16_matmul.clear_cache()
    _, wq, s = _args(16, 512, 512)

    def layers(x):
        for _ in range(3):
            x = x + w8.w8a16_matmul(x, wq, s)
        return x

    jax.make_jaxpr(layers)(_args(16, 512, 512)[0])
    assert len(traced) == 1
