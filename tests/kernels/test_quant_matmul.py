"""Small-M quantized matmul kernels (interpret mode) against their references and
jaxllm's W8A8 / grouped weight-only layer math, and their CUDA lowering at the
Llama-3.1-8B shapes."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda
from kernel_cases import run

from jaxllm.layers.quantization.linear import (block_matmul, grouped_dequant_matmul,
                                               quantize, quantize_per_token,
                                               quantized_matmul)
from jaxllm.layers.quantization.schemes import ActScheme, LinearScheme
from pallas_kernels import common
from pallas_kernels.quant_matmul import (default_dot_dtype, default_settings, quant_matmul,
                                         quant_matmul_int4, ref_quant_matmul,
                                         ref_quant_matmul_int4, smem_bytes)

SD = jax.ShapeDtypeStruct
F32, BF16 = jnp.float32, jnp.bfloat16
STORE = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}
# Small tiles, so a few-hundred-column case takes several steps and splits.
SMALL = dict(block_n=32, block_k=64)


def _w8(seed, n, k, kind):
    """Per-channel quantized weight [N, K] and its scales f32[N]."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    scale = jnp.asarray(np.abs(w).max(axis=1) / (448.0 if kind == "fp8" else 127.0))
    return quantize(jnp.asarray(w), kind, scale[:, None]), scale


def _x(seed, m, k, dtype=F32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)) * 3, dtype)


def _close(got, want, rtol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * np.abs(want).max())


# (M, N, K, settings): ragged N (80 = 2.5 tiles), ragged K (200 = 3 steps + 8 columns),
# 3 splits over 4 steps (the last split is empty: its partial must be zeros).
W8_CASES = [
    (1, 96, 256, dict(k_splits=1)),
    (3, 80, 200, dict(k_splits=2)),
    (8, 64, 256, dict(k_splits=3)),
    (16, 80, 256, dict(k_splits=1)),
    (64, 48, 192, dict(k_splits=2)),
]


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("case", W8_CASES, ids=lambda c: f"m{c[0]}_n{c[1]}_k{c[2]}_{c[3]}")
def test_w8a8_matches_layer_math(kind, case):
    """x quantized per token as the W8A8 layer does; the kernel agrees with the ref and
    with quantized_matmul on the same values (int8 x int8 to the bit: both sums are
    exact integers, the scales applied in the same order)."""
    m, n, k, settings = case
    wq, ws = _w8(m + n, n, k, kind)
    xq, xs = quantize_per_token(_x(k, m, k), 1, ActScheme(kind))
    got = run(functools.partial(quant_matmul, out_dtype=F32, interpret=True, **SMALL,
                                **settings), xq, wq, xs, ws)
    layer = quantized_matmul(xq, xs, wq, ws, 1, native=False)
    _close(got, ref_quant_matmul(xq, wq, xs, ws, out_dtype=F32), 1e-6)
    if kind == "int8" and settings["k_splits"] == 1:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(layer))
    else:
        _close(got, layer, 1e-6)


def test_w8a8_default_output_is_bf16_and_f16_x_gives_the_same():
    """A quantized x handed over widened to f16 (exact) computes the same numbers."""
    wq, ws = _w8(0, 64, 128, "fp8")
    xq, xs = quantize_per_token(_x(1, 5, 128), 1, ActScheme("fp8"))
    fn = functools.partial(quant_matmul, interpret=True, **SMALL)
    got = run(fn, xq, wq, xs, ws)
    assert got.dtype == BF16
    _close(got, ref_quant_matmul(xq, wq, xs, ws), 4e-3)
    np.testing.assert_array_equal(np.asarray(run(fn, xq.astype(jnp.float16), wq, xs, ws)),
                                  np.asarray(got))


def test_static_input_scale():
    """A stored per-tensor input scale (a scalar) broadcasts over the rows."""
    wq, ws = _w8(2, 64, 128, "int8")
    xq = quantize(_x(3, 4, 128), "int8", 0.05)
    got = run(functools.partial(quant_matmul, out_dtype=F32, interpret=True, **SMALL),
              xq, wq, jnp.float32(0.05), ws)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(quantized_matmul(xq, 0.05, wq, ws, 1, False)))


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_weight_only(kind):
    """bf16 x, no x scale: QuantLinear's weight-only math (w widened, f32 sums)."""
    wq, ws = _w8(4, 80, 200, kind)
    x = _x(5, 8, 200, BF16)
    got = run(functools.partial(quant_matmul, interpret=True, out_dtype=F32, k_splits=2,
                                **SMALL), x, wq, None, ws)
    want = jax.lax.dot_general(x, wq.astype(BF16), (((1,), (1,)), ((), ())),
                               preferred_element_type=F32) * ws
    _close(got, want, 1e-5)
    _close(got, ref_quant_matmul(x, wq, None, ws, out_dtype=F32), 1e-5)


# (M, N, K, G, settings): BK above the group (two chunks a step), at it, and below it
# (a group over two steps); ragged N; a split that is empty.
GROUP_CASES = [
    (1, 64, 256, 128, dict(k_splits=2, block_k=256)),
    (8, 80, 256, 64, dict(k_splits=1)),
    (16, 48, 384, 128, dict(k_splits=1, block_k=128)),
    (3, 64, 256, 128, dict(k_splits=3)),
]


@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: f"m{c[0]}_n{c[1]}_k{c[2]}_g{c[3]}")
def test_weight_only_group_scales(case):
    """Block-scaled fp8 (a scale per row and group of G columns), weight-only: the
    kernel against its reference (f32 dequantized weight) and against jaxllm's layer
    math (block_matmul without input quantization, which rounds the dequantized
    weight to bf16)."""
    m, n, k, group, st = case
    rng = np.random.default_rng(9)
    wq = jnp.asarray(rng.standard_normal((n, k)) * 100, jnp.float8_e4m3fn)
    ws = jnp.asarray(rng.uniform(0.001, 0.01, (n, k // group)), F32)
    x = _x(10, m, k, BF16)
    got = run(functools.partial(quant_matmul, interpret=True, out_dtype=F32,
                                **{"block_n": 32, "block_k": 64, **st}), x, wq, None, ws)
    _close(got, ref_quant_matmul(x, wq, None, ws, out_dtype=F32), 1e-5)
    scheme = LinearScheme("fp8", (group, group), None)
    _close(got, block_matmul(x, wq, ws, scheme, 1), 8e-3)
    per_channel = ref_quant_matmul(x, wq, None, ws[:, 0], out_dtype=F32)  # groups matter
    assert np.abs(np.asarray(got) - np.asarray(per_channel)).max() > 0.1 * np.abs(
        np.asarray(per_channel)).max()


def _w4(seed, n, k, group):
    rng = np.random.default_rng(seed)
    groups = -(-k // group)
    packed = jnp.asarray(rng.integers(0, 256, (n, k // 2)), jnp.uint8)
    scale = jnp.asarray(rng.uniform(0.005, 0.02, (n, groups)), F32)
    zero = jnp.asarray(rng.integers(0, 16, (n, groups)), F32)
    return packed, scale, zero


# (M, N, K, group, settings): BK below, at and above the group; K not a multiple of
# the group (its last group partial) nor of BK; a split that is empty.
W4_CASES = [
    (1, 64, 256, 32, dict(k_splits=2)),
    (3, 80, 256, 64, dict(k_splits=1)),
    (8, 64, 256, 128, dict(k_splits=3)),           # BK 64 < group 128
    (16, 96, 200, 64, dict(k_splits=2)),           # 4 groups, the last of 8 columns
    (64, 48, 256, 32, dict(k_splits=1, block_k=128)),
    (3, 40, 192, 64, dict(k_splits=1, block_k=128)),   # ragged K, x's columns split
    (5, 48, 256, 1 << 30, dict(k_splits=2)),           # one group over K (per channel)
    (33, 48, 256, 64, dict(k_splits=2)),               # 17-64 rows: "weight" by default
]


@pytest.mark.parametrize("split_x", [True, False])
@pytest.mark.parametrize("scales", ["output", "weight"])
@pytest.mark.parametrize("case", W4_CASES, ids=lambda c: f"m{c[0]}_n{c[1]}_k{c[2]}_g{c[3]}")
def test_w4a16_matches_layer_math(case, scales, split_x):
    """scales="output" sums exactly what the f32 reference does; "weight" rounds each
    dequantized value (and the scale) to bf16 first."""
    m, n, k, group, settings = case
    packed, scale, zero = _w4(m + k, n, k, group)
    x = _x(n, m, k, BF16)
    got = run(functools.partial(quant_matmul_int4, group=group, out_dtype=F32,
                                interpret=True, scales=scales, split_x=split_x,
                                **{**SMALL, **settings}),
              x, packed, scale, zero)
    want = ref_quant_matmul_int4(x, packed, scale, zero, group=group, out_dtype=F32)
    _close(got, want, 1e-6 if scales == "output" else 8e-3)
    # The jnp layer path rounds each dequantized weight to bf16 (2^-9 relative).
    layer = grouped_dequant_matmul(x, packed, scale, zero, None,
                                   LinearScheme("uint4", group=group), 1)
    _close(got, layer, 4e-3)


@pytest.mark.parametrize("dot_dtype", [jnp.float16, F32], ids=str)
def test_w4a16_nibbles_in_each_dot_dtype(dot_dtype):
    """f16 nibbles (16 + q from f16 bits) and f32 ones (2^23 + q) give the same sums as
    bf16's; this x's bf16 values are exact in f16 and f32."""
    packed, scale, zero = _w4(7, 48, 256, 64)
    x = _x(8, 5, 256, BF16)
    got = run(functools.partial(quant_matmul_int4, group=64, out_dtype=F32, interpret=True,
                                dot_dtype=dot_dtype, k_splits=2, **SMALL),
              x, packed, scale, zero)
    _close(got, ref_quant_matmul_int4(x, packed, scale, zero, group=64, out_dtype=F32), 1e-6)


def test_w4_nibble_order_and_zero_point():
    """One nonzero column at a time: column 2j is byte j's low nibble, 2j + 1 its high
    one, and (q - zero) * scale uses that column's group."""
    n, k, group = 32, 128, 32
    q = np.zeros((n, k), np.int64)
    q[:, 3], q[:, 36] = 5, 11                        # odd column (high), group 1 (low)
    packed = jnp.asarray(q[:, 0::2] | (q[:, 1::2] << 4), jnp.uint8)
    scale = jnp.asarray(np.tile([1.0, 2.0, 4.0, 8.0], (n, 1)), F32)
    zero = jnp.asarray(np.tile([0.0, 1.0, 0.0, 0.0], (n, 1)), F32)
    x = jnp.zeros((1, k), BF16).at[0, 3].set(1.0).at[0, 36].set(10.0)
    got = run(functools.partial(quant_matmul_int4, group=group, out_dtype=F32, block_n=32,
                                block_k=64, interpret=True), x, packed, scale, zero)
    # col 3: (5 - 0) * 1; col 36: (11 - 1) * 2, times 10; zeros elsewhere contribute
    # -zero * scale * x = 0 (x is 0 there).
    np.testing.assert_array_equal(np.asarray(got), np.full((1, n), 5.0 + 200.0))


def test_rejects_what_it_does_not_support():
    wq, ws = _w8(0, 64, 128, "fp8")
    with pytest.raises(ValueError, match="rows"):
        quant_matmul(jnp.zeros((129, 128), BF16), wq, None, ws, interpret=True)
    with pytest.raises(ValueError, match="weight"):
        quant_matmul(jnp.zeros((4, 96), BF16), wq, None, ws, interpret=True)
    with pytest.raises(ValueError, match="powers of two"):
        quant_matmul(jnp.zeros((4, 128), BF16), wq, None, ws, block_n=48, interpret=True)
    packed, scale, zero = _w4(0, 64, 128, 32)
    with pytest.raises(ValueError, match="power of two"):
        quant_matmul_int4(jnp.zeros((4, 128), BF16), packed, scale, zero, group=48)
    with pytest.raises(ValueError, match=">= 32"):
        quant_matmul_int4(jnp.zeros((4, 128), BF16), packed, scale, zero, group=16)
    with pytest.raises(ValueError, match="'output' or 'weight'"):
        quant_matmul_int4(jnp.zeros((4, 128), BF16), packed, scale, zero, group=32,
                          scales="both")
    groups = jnp.ones((64, 4), F32)        # groups of 32 columns
    with pytest.raises(ValueError, match="weight-only"):
        quant_matmul(jnp.zeros((4, 128), BF16), wq, jnp.ones((4,), F32), groups)
    with pytest.raises(ValueError, match="power of two >= 32"):
        quant_matmul(jnp.zeros((4, 128), BF16), wq, None, jnp.ones((64, 8), F32))


# --- the 8B shapes: settings and CUDA lowering ---------------------------------------

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
             "down": (4096, 14336)}


@pytest.mark.parametrize("m", [1, 8, 16, 64])
@pytest.mark.parametrize("proj", list(SHAPES_8B))
@pytest.mark.parametrize("w_bits,x_item,group", [(8, 1, None), (8, 2, None), (4, 2, 32),
                                                 (4, 2, 128)])
def test_default_settings_fit_shared_memory(proj, m, w_bits, x_item, group):
    n, k = SHAPES_8B[proj]
    st = default_settings(m, n, k, w_bits, x_item, group=group)
    gps = 0 if group is None else max(1, st["bk"] // group)
    assert smem_bytes(st["mp"], st["bn"], st["bk"], w_bits, x_item, st["num_stages"],
                      gps) <= common.SMEM_BYTES
    assert st["num_stages"] >= 2 and k % (st["bk"] * st["k_splits"]) == 0


def test_default_k_splits_at_8b_shapes():
    """gate/up's 224 N blocks fill the card alone; o (64 blocks) splits K at decode
    sizes, but not at 64 rows, whose partials would cost more than 1/8 of the weight."""
    def splits(proj, m):
        return default_settings(m, *SHAPES_8B[proj], 8, 1)["k_splits"]
    assert splits("gate_up", 8) == 1
    assert splits("o", 1) == splits("o", 8) == 4 and splits("o", 64) == 1
    assert splits("down", 8) == 4 and splits("qkv", 8) == 2


def test_default_int4_settings_at_8b_shapes():
    """4-bit weights at M = 16 take the splits measured fastest on the H200 (4 for qkv,
    o and down, none for gate/up), fewer as M grows."""
    def splits(proj, m):
        return default_settings(m, *SHAPES_8B[proj], 4, 2, group=128)["k_splits"]
    assert [splits(p, 16) for p in ("qkv", "o", "gate_up", "down")] == [4, 4, 1, 4]
    assert splits("o", 32) == 2 and splits("o", 64) == 1 and splits("down", 64) == 2


@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.parametrize("proj", list(SHAPES_8B))
@pytest.mark.parametrize("kind", ["fp8", "int8", "bf16_x"])
def test_w8_lowers_at_8b_shapes(kind, proj, m):
    n, k = SHAPES_8B[proj]
    wdt = STORE["fp8" if kind == "bf16_x" else kind]
    w, ws = SD((n, k), wdt), SD((n,), F32)
    if kind == "bf16_x":
        x = SD((m, k), BF16)
        text = lower_for_cuda(lambda x, w, ws: quant_matmul(x, w, None, ws), x, w, ws)
    else:
        x = SD((m, k), wdt)
        text = lower_for_cuda(quant_matmul, x, w, SD((m,), F32), ws)
    st = default_settings(m, n, k, 8, x.dtype.itemsize)
    assert "__gpu$xla.gpu.triton" in text
    assert f"grid_x = {n // st['bn']}" in text and f"grid_y = {st['k_splits']}" in text


@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.parametrize("proj", list(SHAPES_8B))
@pytest.mark.parametrize("group", [32, 128])
def test_w4a16_lowers_at_8b_shapes(proj, m, group):
    n, k = SHAPES_8B[proj]
    fn = functools.partial(quant_matmul_int4, group=group)
    text = lower_for_cuda(fn, SD((m, k), BF16), SD((n, k // 2), jnp.uint8),
                          SD((n, k // group), F32), SD((n, k // group), F32))
    st = default_settings(m, n, k, 4, 2, group=group)
    assert "__gpu$xla.gpu.triton" in text
    assert f"grid_x = {n // st['bn']}" in text and f"grid_y = {st['k_splits']}" in text


QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
            "down": (4096, 12288)}


@pytest.mark.parametrize("m", [8, 64])
@pytest.mark.parametrize("proj", list(QWEN3_8B))
def test_block_fp8_lowers_at_qwen3_8b_shapes(proj, m):
    """Weight-only with 128-column group scales (the Qwen3-*-FP8 releases' blocks)."""
    n, k = QWEN3_8B[proj]
    text = lower_for_cuda(lambda x, w, ws: quant_matmul(x, w, None, ws), SD((m, k), BF16),
                          SD((n, k), STORE["fp8"]), SD((n, k // 128), F32))
    st = default_settings(m, n, k, 8, 2)
    assert "__gpu$xla.gpu.triton" in text
    assert f"grid_x = {n // st['bn']}" in text and f"grid_y = {st['k_splits']}" in text


@pytest.mark.parametrize("settings", [dict(dot_dtype=jnp.float8_e4m3fn),
                                      dict(block_n=128, block_k=512, num_stages=2),
                                      dict(block_n=32, block_k=128, k_splits=8)], ids=str)
def test_sweep_settings_lower(settings):
    """Settings a GPU sweep may try at o's shape, M = 8 (fp8 x fp8 as an fp8 dot)."""
    fp8 = STORE["fp8"]
    text = lower_for_cuda(functools.partial(quant_matmul, **settings), SD((8, 4096), fp8),
                          SD((4096, 4096), fp8), SD((8,), F32), SD((4096,), F32))
    assert "__gpu$xla.gpu.triton" in text


def test_weight_only_f16_dot_lowers():
    fn = functools.partial(quant_matmul, dot_dtype=jnp.float16)
    text = lower_for_cuda(lambda x, w, ws: fn(x, w, None, ws), SD((8, 4096), BF16),
                          SD((4096, 4096), jnp.int8), SD((4096,), F32))
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_weight_only_fp8_dots_run_in_f16(kind):
    """Weight-only under a bf16 x: an fp8 weight's dots run in f16 (the Triton call
    takes x cast to f16: e4m3 -> bf16 costs a conversion per value more), clamped to
    f16's range so that a bf16 value past 65504 stays finite; an int8 weight's in
    bf16. The numbers are the reference's on the clamped x."""
    wq, ws = _w8(13, 64, 256, kind)
    text = lower_for_cuda(lambda x, w, ws: quant_matmul(x, w, None, ws),
                          SD((16, 256), BF16), SD((64, 256), STORE[kind]), SD((64,), F32))
    call = next(line for line in text.splitlines() if "xla.gpu.triton" in line)
    assert f"tensor<16x256x{'f16' if kind == 'fp8' else 'bf16'}>" in call
    x = _x(14, 16, 256, BF16).at[2, 5].set(2e5).at[7, 11].set(-3e9)
    got = run(functools.partial(quant_matmul, interpret=True, out_dtype=F32, **SMALL),
              x, wq, None, ws)
    clamped = jnp.clip(x.astype(F32), -65504, 65504).astype(BF16 if kind == "int8" else F32)
    want = ref_quant_matmul(clamped if kind == "fp8" else x, wq, None, ws, out_dtype=F32)
    _close(got, want, 1e-5)


@pytest.mark.parametrize("x,w,scaled,want", [
    (BF16, "fp8", False, jnp.float16), (jnp.float16, "fp8", False, jnp.float16),
    (F32, "fp8", False, F32), (BF16, "int8", False, BF16), (F32, "int8", False, F32),
    ("fp8", "fp8", True, jnp.float16), ("int8", "int8", True, jnp.int8),
    (jnp.float16, "int8", True, jnp.float16)])
def test_default_dot_dtype(x, w, scaled, want):
    """The dots' dtype: f16 for fp8 weights under a 16-bit x and for quantized x (exact
    for e4m3 and int8 values), the int8 dot for int8 x int8, else x's dtype."""
    x, w = STORE.get(x, x), STORE[w]
    assert default_dot_dtype(x, w, 1.0 if scaled else None) == jnp.dtype(want)
