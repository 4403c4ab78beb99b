"""uint4 group scales stored packed for the Mosaic W4A16 kernel (int4_kernels.py):
which schemes take it, what the loader and the dummy weights store, and the numbers
through every path that reads them (XLA's dequantize-then-dot on the CPU, the Mosaic
and Triton kernels in interpret mode) against the same checkpoint's f32 scales."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import int_checkpoints as ic
import quant_util as qu
from jaxllm.layers.quantization import int4_kernels, linear
from jaxllm.layers.quantization.schemes import LinearScheme
from jaxllm.models.loader import load_model, read_hf_config
from jaxllm.models.quant_config import resolve_for_tp
from jaxllm.models.registry import arch_from_hf_config
from pallas_kernels import w4a16_mgpu

G128 = LinearScheme("uint4", group=128)
PACKED = LinearScheme("uint4", group=128, packed=True)
# widths the kernel tiles: every projection's N a multiple of 128, K of 4 groups
SHAPES = dict(hidden_size=512, intermediate_size=512, num_attention_heads=4,
              num_key_value_heads=2, head_dim=128)
DOWN = ("layers", 0, "mlp", "down_proj")


def _awq(tmp_path, method="awq", **kw):
    folder = str(tmp_path / method)
    hf = qu.make_model(folder, "llama", **SHAPES)
    ic.write_gptq_or_awq(folder, hf, method, group=128, **({"sym": False} | kw))
    return folder, hf


def test_packed_where_the_mosaic_kernel_runs(tmp_path, monkeypatch):
    """One device, a Hopper GPU, a bf16 model, the kernel on: every uint4 g128 scheme."""
    folder, _ = _awq(tmp_path)
    hf = read_hf_config(folder)
    arch = arch_from_hf_config(hf)
    monkeypatch.setattr(int4_kernels, "is_hopper", lambda: True)
    monkeypatch.delenv("JAXLLM_INT4_MOSAIC", raising=False)

    def packed(tp=1, dtype=jnp.bfloat16):
        return [s.packed for _, s in resolve_for_tp(hf, None, arch, folder, tp,
                                                    dtype=dtype).schemes]
    assert all(packed())
    assert not any(packed(tp=2)) and not any(packed(dtype=jnp.float16))
    assert not any(packed(dtype=None))
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", "0")
    assert not any(packed())
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", "1")
    monkeypatch.setattr(int4_kernels, "is_hopper", lambda: False)
    assert not any(packed())
    assert not int4_kernels.packable(LinearScheme("uint4", group=64))
    assert not int4_kernels.packable(LinearScheme("uint4", group=128, g_idx=True))
    assert not int4_kernels.packable(LinearScheme("uint8", group=128))
    monkeypatch.setattr(int4_kernels, "is_hopper", lambda: True)
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", "yes")
    with pytest.raises(ValueError, match="JAXLLM_INT4_MOSAIC='yes': 0 or 1 expected"):
        packed()


def _down(llm_or_loaded):
    state = getattr(llm_or_loaded, "state", None)
    if state is None:
        state = llm_or_loaded.llm_engine.runner.state
    flat = dict(nnx.to_flat_state(state))
    return {name: np.asarray(flat[DOWN + (name,)].get_value())
            for name in ("weight", "weight_scale", "weight_zero_point")
            if DOWN + (name,) in flat}


def _bf16_scales(tensors):
    """Scales rounded to bf16 values (fp16 holds them exactly): packing then loses
    nothing, so a packed and an f32 load dequantize to the same weights."""
    import torch
    for name, t in tensors.items():
        if name.endswith((".scales", ".weight_scale")):
            tensors[name] = t.to(torch.bfloat16).to(t.dtype)


@pytest.mark.parametrize("method,kw", [("awq", {}), ("gptq", dict(sym=True)),
                                       ("gptq", dict(version="gptq_v2")),
                                       ("pack", dict(sym=False))],
                         ids=["awq", "gptq-sym", "gptq_v2-asym", "pack-quantized-asym"])
def test_packed_load_decodes_as_f32_scales(tmp_path, monkeypatch, method, kw):
    """A 4-bit checkpoint (AWQ, GPTQ v1 / v2, compressed-tensors pack-quantized) loaded
    packed (bf16 model, a Hopper GPU faked): down_proj's scales are pack_scales of the
    f32 load's, with no zero-point parameter, and greedy decoding on this CPU (XLA's
    path, which unpacks them) gives the f32 load's tokens (scales that bf16 holds
    exactly, so both loads' weights are the same numbers)."""
    folder = qu.edited_copy(_awq(tmp_path, method, **kw)[0], tmp_path / "bf16-scales",
                            edit_tensors=_bf16_scales)
    prompts = qu.prompts(qu.shared().TINY_VOCAB)
    loads = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("JAXLLM_INT4_MOSAIC", switch)
        monkeypatch.setattr(int4_kernels, "is_hopper", lambda: True)
        tokens, llm = qu.jaxllm_greedy(folder, prompts, 12, dtype="bfloat16")
        loads[switch] = tokens, _down(llm)
        del llm
    (f32_tokens, f32), (packed_tokens, packed) = loads["0"], loads["1"]
    assert set(packed) == {"weight", "weight_scale"} and packed["weight_scale"].shape == (8, 512)
    np.testing.assert_array_equal(packed["weight"], f32["weight"])
    want = w4a16_mgpu.pack_scales(jnp.asarray(f32["weight_scale"]),
                                  jnp.asarray(f32["weight_zero_point"]))
    np.testing.assert_array_equal(packed["weight_scale"], np.asarray(want))
    assert packed_tokens == f32_tokens


def test_dummy_packed_scales(tiny_model, monkeypatch):
    """--load-format dummy on the kernel's machines: scale rows ~0.035 / 8 and
    zero-point rows 8, the same numbers as the unpacked dummy scales (a bf16 value),
    and the same random bytes (keyed by name, not by the parameters before them, of
    which packing removes some), so both dequantize to the same weights."""
    folder, _ = tiny_model("llama")
    monkeypatch.setattr(w4a16_mgpu, "supported", lambda n, k, tile_n=128: True)
    loads = {}
    for hopper in (True, False):
        monkeypatch.setattr(int4_kernels, "is_hopper", lambda: hopper)
        loads[hopper] = _down(load_model(folder, "bfloat16", "dummy", quantization="awq"))
    packed, f32 = loads[True], loads[False]
    assert set(packed) == {"weight", "weight_scale"} and len(f32) == 3
    np.testing.assert_array_equal(packed["weight"], f32["weight"])
    s = packed["weight_scale"].astype(np.float32)
    np.testing.assert_allclose(s[0::2], 0.035 / 8, rtol=1e-2)
    np.testing.assert_array_equal(s[1::2], 8.0)
    n = f32["weight_scale"].shape[0]
    np.testing.assert_array_equal(s, np.asarray(w4a16_mgpu.pack_scales(
        jnp.asarray(f32["weight_scale"]), jnp.asarray(f32["weight_zero_point"]))).reshape(-1, n))
    np.testing.assert_array_equal(f32["weight_scale"],
                                  np.asarray(int4_kernels.unpack(packed["weight_scale"], (n,))[0]))


@pytest.mark.parametrize("mosaic", ["1", "0"], ids=["mosaic", "triton"])
def test_kernels_read_packed_scales(monkeypatch, mosaic):
    """int4_kernel_matmul on packed scales, through the Mosaic kernel (as they are) or
    the Triton one (unpacked), equals its result on the same scales unpacked."""
    monkeypatch.setattr(int4_kernels, "is_hopper", lambda: True)
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", mosaic)
    rng = np.random.default_rng(7)
    out_shape, k = (2, 2, 128), 512
    q = jnp.asarray(rng.integers(0, 256, out_shape + (k // 2,)).astype(np.uint8))
    scale = jnp.asarray(rng.uniform(0.005, 0.02, out_shape + (k // 128,)), jnp.float32)
    zero = jnp.asarray(rng.integers(0, 16, out_shape + (k // 128,)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((6, k)), jnp.bfloat16)
    packed = jnp.asarray(int4_kernels.pack(np.asarray(scale), np.asarray(zero)))
    assert packed.shape == (8, 512) and int4_kernels.is_packed(PACKED, 512, k)
    s32, z32 = int4_kernels.unpack(packed, out_shape)
    want = int4_kernels.int4_kernel_matmul(x, q, s32, z32, G128, 1, interpret=True)
    got = int4_kernels.int4_kernel_matmul(x, q, packed, None, PACKED, 1, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # XLA's path (a layer's prefill) unpacks them the same way
    nnx.use_eager_sharding(False)
    layer = linear.QuantLinear(PACKED, out_shape, (k,), (None,) * 3, (None,))
    assert not hasattr(layer, "weight_zero_point") and layer.weight_scale.shape == (8, 512)
    layer.weight[...], layer.weight_scale[...] = q, packed
    xla = linear.grouped_dequant_matmul(x, q, s32, z32, None, G128, 1)
    np.testing.assert_array_equal(np.asarray(layer(x, tp=2)), np.asarray(xla.astype(x.dtype)))


def test_packed_layer_lowers_to_the_mosaic_kernel(monkeypatch):
    """A packed layer lowered for the H200 at decode sizes: the Mosaic kernel reads the
    bf16 [2 K/G, N] parameter as it is (no f32 scales, no unpacking transpose)."""
    from cuda_lowering import lower_for_cuda
    nnx.use_eager_sharding(False)
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", "1")
    layer = linear.QuantLinear(PACKED, (2, 8, 128), (4096,), (None,) * 3, (None,))
    graph, state = nnx.split(layer)

    def call(state, x):
        return nnx.merge(graph, state)(x, tp=1)
    text = lower_for_cuda(call, state, jax.ShapeDtypeStruct((16, 4096), jnp.bfloat16))
    assert "mosaic_gpu" in text and "quant_matmul_int4" not in text
    assert "tensor<64x2048xbf16>" in text and "x32xf32>" not in text
