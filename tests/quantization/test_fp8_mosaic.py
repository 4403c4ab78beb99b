"""QuantLinear's weight-only fp8 layers through the Mosaic GPU kernel
(JAXLLM_FP8_MOSAIC=1, off by default): where it applies, what the layer lowers to for
a Hopper GPU at decode and prefill sizes, and the layer's numbers through it (GPU
interpret mode) against XLA's weight-only path."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from jaxllm.layers.quantization import fp8_kernels, linear
from jaxllm.layers.quantization.schemes import ActScheme, LinearScheme

FP8 = LinearScheme("fp8", act=ActScheme(dtype="fp8", dynamic=True))
SD = jax.ShapeDtypeStruct


def _shapes(t=16, n=4096, k=4096, scale=None):
    return (SD((t, k), jnp.bfloat16), SD((n, k), jnp.float8_e4m3fn),
            SD((n,) if scale is None else scale, jnp.float32))


def test_mosaic_only_where_it_applies(monkeypatch):
    monkeypatch.setattr(fp8_kernels, "is_hopper", lambda: True)
    monkeypatch.delenv("JAXLLM_FP8_MOSAIC", raising=False)
    use = fp8_kernels.use_mosaic_fp8
    assert not use(*_shapes(), 1, True)                       # off by default
    monkeypatch.setenv("JAXLLM_FP8_MOSAIC", "1")
    assert use(*_shapes(), 1, True)
    assert use(*_shapes(scale=()), 1, True)                   # a per-tensor scale
    assert use(*_shapes(t=64), 1, True)
    assert not use(*_shapes(t=65), 1, True)                   # past the kernel's rows
    assert not use(*_shapes(), 1, False)                      # a sharded weight
    assert not use(*_shapes(n=4096 + 64), 1, True)            # N off the 128 tiles
    assert not use(*_shapes(scale=(4096, 32)), 1, True)       # block scales
    x, w, s = _shapes()
    assert not use(SD(x.shape, jnp.float32), w, s, 1, True)   # a 32-bit input
    assert not use(x, SD(w.shape, jnp.int8), s, 1, True)      # int8 weights
    monkeypatch.setattr(fp8_kernels, "is_hopper", lambda: False)
    assert not use(*_shapes(), 1, True)
    monkeypatch.setenv("JAXLLM_FP8_MOSAIC", "on")
    with pytest.raises(ValueError, match="JAXLLM_FP8_MOSAIC='on': 0 or 1 expected"):
        use(*_shapes(), 1, True)


def test_named_settings(monkeypatch):
    monkeypatch.setenv("JAXLLM_W8A16_SETTINGS", '{"4096x4096": {"k_splits": 4, "cols": 256}}')
    assert fp8_kernels.kernel_settings(4096, 4096, 16) == {"k_splits": 4, "cols": 256}
    assert fp8_kernels.kernel_settings(4096, 4096, 32) == {}      # past the sweep's rows
    assert fp8_kernels.kernel_settings(6144, 4096, 16) == {}
    monkeypatch.setenv("JAXLLM_W8A16_SETTINGS", '{"4096x4096": {"splits": 4}}')
    with pytest.raises(ValueError, match=r"JAXLLM_W8A16_SETTINGS: unknown settings \['splits'\]"):
        fp8_kernels.kernel_settings(4096, 4096, 16)
    for value, why in (("{k_splits: 4}", "not JSON"), ('[1, 2]', "expected"),
                       ('{"4096x4096": 4}', "expected")):
        monkeypatch.setenv("JAXLLM_W8A16_SETTINGS", value)
        with pytest.raises(ValueError, match=f"JAXLLM_W8A16_SETTINGS: .*{why}"):
            fp8_kernels.kernel_settings(4096, 4096, 16)


@pytest.mark.parametrize("switch,tokens,kernel", [("1", 16, True), ("0", 16, False),
                                                  ("1", 128, False)])
def test_layer_lowers_to_the_mosaic_kernel_for_hopper(monkeypatch, switch, tokens, kernel):
    """Lowered for the H200 (lower_for_cuda's abstract device): the Mosaic kernel at
    decode sizes with the switch on; XLA's weight-only dot with it off; above
    WEIGHT_ONLY_ROWS the W8A8 path (an fp8 x fp8 dot) either way."""
    from flax import nnx
    nnx.use_eager_sharding(False)
    monkeypatch.setenv("JAXLLM_FP8_MOSAIC", switch)
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    layer = linear.QuantLinear(FP8, (2, 8, 128), (4096,), (None,) * 3, (None,))
    graph, state = nnx.split(layer)

    def call(state, x):
        return nnx.merge(graph, state)(x, tp=1)
    text = lower_for_cuda(call, state, SD((tokens, 4096), jnp.bfloat16))
    assert ("mosaic_gpu" in text) == kernel
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    if kernel:
        assert not dots
    elif tokens > linear.WEIGHT_ONLY_ROWS["fp8"]:
        assert f"tensor<{tokens}x4096xf8E4M3FN>" in dots[0]           # the input quantized
    else:
        assert "tensor<16x4096xf16>, tensor<2x8x128x4096xf16>" in dots[0]  # widened


@pytest.mark.parametrize("in_shape,out_shape,scale", [
    ((512,), (2, 2, 64), "channel"), ((4, 128), (128,), "channel"), ((1024,), (256,), "tensor")],
    ids=["kv_proj", "o_proj", "per_tensor"])
def test_layer_through_mosaic_matches_xla(in_shape, out_shape, scale):
    """fp8_kernel_matmul (interpret mode) flattens a projection's dims as XLA's
    weight-only path reads them, and applies its scales the same way."""
    rng = np.random.default_rng(7)
    k = int(np.prod(in_shape))
    wq = jnp.asarray(rng.standard_normal(out_shape + in_shape) * 60, jnp.float8_e4m3fn)
    ws = jnp.asarray(rng.uniform(1e-3, 4e-3, out_shape if scale == "channel" else ()),
                     jnp.float32)
    x = jnp.asarray(rng.standard_normal((6,) + in_shape), jnp.bfloat16)
    nk = len(in_shape)
    got = fp8_kernels.fp8_kernel_matmul(x, wq, ws, nk, interpret=True)
    want = linear.weight_only_matmul(x, wq, ws, nk)
    assert got.shape == want.shape == (6,) + out_shape and k % 128 == 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-5 * float(np.abs(np.asarray(want)).max()))
