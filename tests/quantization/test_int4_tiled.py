"""uint4 weights stored in the Mosaic W4A16 kernel's tile order (JAXLLM_INT4_TILED=1,
int4_layout.py): which schemes take it, the loader's bytes, and the numbers through
every path that reads them (XLA's dequantize-then-dot on the CPU, the Mosaic and
Triton kernels in interpret mode) against the same checkpoint stored in row order."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import quant_util as qu
from jaxllm.layers.quantization import int4_layout, linear
from jaxllm.layers.quantization.schemes import LinearScheme
from jaxllm.models.loader import read_hf_config
from jaxllm.models.quant_config import resolve_for_tp
from jaxllm.models.registry import arch_from_hf_config
from pallas_kernels import w4a16_mgpu

G128 = LinearScheme("uint4", group=128)
TILED = LinearScheme("uint4", group=128, tiled=True)
# widths the kernel tiles: every projection's N a multiple of 128, K of 4 groups
SHAPES = dict(hidden_size=512, intermediate_size=512, num_attention_heads=4,
              num_key_value_heads=2, head_dim=128)


def test_switch_marks_uint4_g128_schemes_on_one_device(tmp_path, monkeypatch):
    folder = str(tmp_path / "awq")
    qu.write_gptq_or_awq(folder, qu.make_model(folder, "llama", **SHAPES), "awq", group=128,
                         sym=False)
    hf = read_hf_config(folder)
    arch = arch_from_hf_config(hf)
    monkeypatch.setenv("JAXLLM_INT4_TILED", "1")
    assert all(s.tiled for _, s in resolve_for_tp(hf, None, arch, folder, 1).schemes)
    assert not any(s.tiled for _, s in resolve_for_tp(hf, None, arch, folder, 2).schemes)
    monkeypatch.setenv("JAXLLM_INT4_TILED", "0")
    assert not any(s.tiled for _, s in resolve_for_tp(hf, None, arch, folder, 1).schemes)
    assert not int4_layout.tileable(LinearScheme("uint4", group=64))
    assert not int4_layout.tileable(LinearScheme("uint4", group=128, g_idx=True))
    assert not int4_layout.tileable(LinearScheme("uint8", group=128))
    monkeypatch.setenv("JAXLLM_INT4_TILED", "yes")
    with pytest.raises(ValueError, match="JAXLLM_INT4_TILED='yes': 0 or 1 expected"):
        resolve_for_tp(hf, None, arch, folder, 1)


def test_tiled_load_decodes_as_row_order(tmp_path, monkeypatch):
    """An AWQ checkpoint loaded tiled: its bytes are the row-order load's in tile order
    (down_proj's tile (1, 2) = rows 128.. and group 2's bytes), and greedy decoding
    (XLA's path, which reads them back in row order) matches HF transformers."""
    folder = str(tmp_path / "awq")
    hf = qu.make_model(folder, "llama", **SHAPES)
    qu.write_gptq_or_awq(folder, hf, "awq", group=128, sym=False)
    prompts = qu.prompts(qu.shared().TINY_VOCAB)
    loads = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("JAXLLM_INT4_TILED", switch)
        tokens, llm = qu.jaxllm_greedy(folder, prompts, 12)
        state = dict(nnx.to_flat_state(llm.llm_engine.runner.state))
        loads[switch] = tokens, np.asarray(
            state[("layers", 0, "mlp", "down_proj", "weight")].get_value())
        del llm
    (rows_tokens, rows), (tiled_tokens, tiled) = loads["0"], loads["1"]
    assert tiled.shape == rows.shape == (512, 256) and not np.array_equal(tiled, rows)
    np.testing.assert_array_equal(tiled, int4_layout.tile_stored(rows, 512))
    view = tiled.reshape(4, 4, 128, 64)
    np.testing.assert_array_equal(view[1, 2], rows[128:256, 128:192])
    assert tiled_tokens == rows_tokens == qu.hf_greedy(hf, prompts, 12)


@pytest.mark.parametrize("mosaic", ["1", "0"], ids=["mosaic", "triton"])
def test_kernels_read_tiled_bytes(monkeypatch, mosaic):
    """int4_kernel_matmul on tiled bytes, through the Mosaic kernel (tiled operand) or
    the Triton one (bytes put back in row order), equals its result on row order."""
    monkeypatch.setattr(linear, "is_hopper", lambda: True)
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", mosaic)
    rng = np.random.default_rng(7)
    out_shape, k = (2, 2, 128), 512
    rows = rng.integers(0, 256, out_shape + (k // 2,)).astype(np.uint8)
    scale = jnp.asarray(rng.uniform(0.005, 0.02, out_shape + (k // 128,)), jnp.float32)
    zero = jnp.asarray(rng.integers(0, 16, out_shape + (k // 128,)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((6, k)), jnp.bfloat16)
    assert int4_layout.is_tiled(TILED, 512, k) and w4a16_mgpu.supported(512, k)
    tiled = jnp.asarray(int4_layout.tile_stored(rows, 512))
    want = linear.int4_kernel_matmul(x, jnp.asarray(rows), scale, zero, G128, 1,
                                     interpret=True)
    got = linear.int4_kernel_matmul(x, tiled, scale, zero, TILED, 1, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(int4_layout.in_row_order(tiled, TILED, 1)), rows)


def test_tiled_layer_lowers_to_the_mosaic_kernel(monkeypatch):
    """A tiled layer lowered for the H200 at decode sizes: the Mosaic kernel on its
    bytes as stored (a reshape to the tile view), no kernel putting them in row order."""
    from cuda_lowering import lower_for_cuda
    nnx.use_eager_sharding(False)
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", "1")
    layer = linear.QuantLinear(TILED, (2, 8, 128), (4096,), (None,) * 3, (None,))
    graph, state = nnx.split(layer)

    def call(state, x):
        return nnx.merge(graph, state)(x, tp=1)
    text = lower_for_cuda(call, state, jax.ShapeDtypeStruct((16, 4096), jnp.bfloat16))
    assert "mosaic_gpu" in text and "quant_matmul_int4" not in text
    # the weight [2, 8, 128, 2048] bytes reach the kernel as [16, 32, 128, 64]
    assert "tensor<16x32x128x64xui8>" in text
