"""QuantLinear's uint4 layers through the Mosaic GPU kernel (JAXLLM_INT4_MOSAIC, on
by default):
where it applies, what the layer lowers to for a Hopper GPU, and the layer's numbers
through it (GPU interpret mode) against XLA's dequantize-then-dot."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from jaxllm.layers.quantization import int4_kernels, linear
from jaxllm.layers.quantization.schemes import LinearScheme

G128 = LinearScheme("uint4", group=128)


def test_mosaic_only_where_it_applies(monkeypatch):
    monkeypatch.setattr(int4_kernels, "is_hopper", lambda: True)
    monkeypatch.delenv("JAXLLM_INT4_MOSAIC", raising=False)
    bf16 = jnp.bfloat16
    assert int4_kernels.use_mosaic_int4(G128, 4096, 4096, bf16)       # on by default on Hopper
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", "1")
    assert int4_kernels.use_mosaic_int4(G128, 4096, 4096, bf16)
    assert not int4_kernels.use_mosaic_int4(LinearScheme("uint4", group=64), 4096, 4096, bf16)
    assert not int4_kernels.use_mosaic_int4(G128, 4096 + 64, 4096, bf16)   # N off the 128 tiles
    assert not int4_kernels.use_mosaic_int4(G128, 4096, 128 * 3, bf16)     # no 4-group split
    # its arithmetic is bf16: an f16 model keeps the Triton kernel, which computes in f16
    assert not int4_kernels.use_mosaic_int4(G128, 4096, 4096, jnp.float16)
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", "0")
    assert not int4_kernels.use_mosaic_int4(G128, 4096, 4096, bf16)
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", "1")
    monkeypatch.setattr(int4_kernels, "is_hopper", lambda: False)
    assert not int4_kernels.use_mosaic_int4(G128, 4096, 4096, bf16)
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", "yes")
    with pytest.raises(ValueError, match="JAXLLM_INT4_MOSAIC='yes': 0 or 1 expected"):
        int4_kernels.use_mosaic_int4(G128, 4096, 4096, bf16)


@pytest.mark.parametrize("switch,kernel", [("1", "mosaic_gpu"), ("0", "quant_matmul_int4")])
def test_layer_lowers_to_the_mosaic_kernel_for_hopper(monkeypatch, switch, kernel):
    """Lowered for the H200 (lower_for_cuda's abstract device) at decode sizes: the
    Mosaic kernel with the switch on, the Triton kernel with it off."""
    from flax import nnx
    nnx.use_eager_sharding(False)
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", switch)
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    layer = linear.QuantLinear(G128, (2, 8, 128), (4096,), (None,) * 3, (None,))
    graph, state = nnx.split(layer)

    def call(state, x):
        return nnx.merge(graph, state)(x, tp=1)
    text = lower_for_cuda(call, state, jax.ShapeDtypeStruct((16, 4096), jnp.bfloat16))
    assert kernel in text
    assert ("quant_matmul_int4" in text) == (switch == "0")


@pytest.mark.parametrize("in_shape,out_shape", [((512,), (2, 2, 64)), ((4, 128), (128,))],
                         ids=["kv_proj", "o_proj"])
def test_layer_through_mosaic_matches_xla_dequant(monkeypatch, in_shape, out_shape):
    """int4_kernel_matmul's Mosaic branch (interpret mode) flattens a projection's dims
    as XLA's path reads them: the same numbers within the bf16 roundings of the scales
    and of each dequantized weight."""
    monkeypatch.setattr(int4_kernels, "is_hopper", lambda: True)
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", "1")
    rng = np.random.default_rng(5)
    k = int(np.prod(in_shape))
    packed = jnp.asarray(rng.integers(0, 256, out_shape + in_shape[:-1] + (in_shape[-1] // 2,)),
                         jnp.uint8)
    scale = jnp.asarray(rng.uniform(0.005, 0.02, out_shape + (k // 128,)), jnp.float32)
    zero = jnp.asarray(rng.integers(0, 16, out_shape + (k // 128,)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((6,) + in_shape), jnp.bfloat16)
    nk = len(in_shape)
    assert int4_kernels.use_mosaic_int4(G128, int(np.prod(out_shape)), k, x.dtype)
    got = int4_kernels.int4_kernel_matmul(x, packed, scale, zero, G128, nk, interpret=True)
    want = linear.grouped_dequant_matmul(x, packed, scale, zero, None, G128, nk)
    assert got.shape == want.shape == (6,) + out_shape
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max()
    assert err < 6e-3 * np.abs(np.asarray(want, np.float32)).max()


def test_settings_named_in_the_environment(monkeypatch):
    """JAXLLM_W4A16_SETTINGS names the Mosaic kernel's settings per [N, K] projection for
    steps of up to 16 tokens (a device sweep's pick tried in the engine); other shapes
    and larger steps keep the kernel's defaults, and an unknown setting is refused."""
    monkeypatch.setenv(int4_kernels.SETTINGS_ENV,
                       '{"28672x4096": {"k_splits": 8, "tiles": 7}, "4096x4096": {}}')
    assert int4_kernels.mosaic_settings(28672, 4096, 16) == {"k_splits": 8, "tiles": 7}
    assert int4_kernels.mosaic_settings(28672, 4096, 17) == {}
    assert int4_kernels.mosaic_settings(4096, 14336, 1) == {}
    monkeypatch.setenv(int4_kernels.SETTINGS_ENV, '{"4096x4096": {"split": 2}}')
    with pytest.raises(ValueError, match=r"JAXLLM_W4A16_SETTINGS: unknown settings \['split'\] "
                                         "for 4096x4096"):
        int4_kernels.mosaic_settings(4096, 4096, 1)
    monkeypatch.delenv(int4_kernels.SETTINGS_ENV)
    assert int4_kernels.mosaic_settings(4096, 4096, 1) == {}


def test_layer_takes_the_named_settings(monkeypatch):
    """The layer passes the named settings to the kernel: two tiles a program give the
    same numbers as the defaults (interpret mode), and a setting the shape cannot take
    reaches the kernel's refusal."""
    monkeypatch.setattr(int4_kernels, "is_hopper", lambda: True)
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", "1")
    rng = np.random.default_rng(6)
    packed = jnp.asarray(rng.integers(0, 256, (256, 256)), jnp.uint8)
    scale = jnp.asarray(rng.uniform(0.005, 0.02, (256, 4)), jnp.float32)
    zero = jnp.asarray(rng.integers(0, 16, (256, 4)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
    args = (x, packed, scale, zero, G128, 1)
    monkeypatch.delenv(int4_kernels.SETTINGS_ENV, raising=False)
    want = int4_kernels.int4_kernel_matmul(*args, interpret=True)
    monkeypatch.setenv(int4_kernels.SETTINGS_ENV, '{"256x512": {"k_splits": 1, "tiles": 2}}')
    got = int4_kernels.int4_kernel_matmul(*args, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2 * float(np.abs(np.asarray(want, np.float32)).max()))
    monkeypatch.setenv(int4_kernels.SETTINGS_ENV, '{"256x512": {"tiles": 3}}')
    with pytest.raises(ValueError, match="tiles 3: must divide N's 2 tiles"):
        int4_kernels.int4_kernel_matmul(*args, interpret=True)
