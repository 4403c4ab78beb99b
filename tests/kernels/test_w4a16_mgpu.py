"""The Mosaic GPU W4A16 kernel (pallas_kernels/w4a16_mgpu.py): its plain-jnp twin
against the checkpoint layout's reference, the kernel in GPU interpret mode against
the twin, and its lowering for CUDA (Mosaic's layout inference runs there, on this
CPU)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from pallas_kernels import quant_matmul as qmm
from pallas_kernels import w4a16_mgpu as w4

G = w4.GROUP


def _checkpoint(n, k, seed=0):
    """Random uint4 weights two a byte, f32 scales and integer zero points."""
    ks = jax.random.split(jax.random.key(seed), 3)
    wu8 = jax.random.randint(ks[0], (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    s = jax.random.uniform(ks[1], (n, k // G), jnp.float32, 0.01, 0.02)
    z = jnp.round(jax.random.uniform(ks[2], (n, k // G), jnp.float32, 0.0, 15.0))
    return wu8, s, z


def _x(m, k, seed=1):
    return jax.random.normal(jax.random.key(seed), (m, k), jnp.float32).astype(jnp.bfloat16)


def test_as_int4_rereads_the_bytes():
    """Column 2j is a byte's low nibble in both layouts; uint4 q reads as q - 16 from 8."""
    wu8, _, _ = _checkpoint(8, 256)
    q = np.asarray(w4.as_int4(wu8)).astype(np.int32)
    b = np.asarray(wu8).astype(np.int32)
    nibbles = np.stack([b & 15, b >> 4], axis=-1).reshape(8, 256)
    np.testing.assert_array_equal(q, np.where(nibbles >= 8, nibbles - 16, nibbles))


def test_twin_matches_the_checkpoint_reference():
    """The twin computes what the checkpoint's weights mean, to the bf16 rounding of
    the scales and the widened weight."""
    wu8, s, z = _checkpoint(64, 512)
    x = _x(4, 512)
    want = qmm.ref_quant_matmul_int4(x, wu8, s, z, group=G, out_dtype=jnp.float32)
    got = w4.ref_w4a16_matmul(x, w4.as_int4(wu8), s, z, out_dtype=jnp.float32)
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(got - want))) < 5e-3 * scale
    # and not by accident: the uint4 values taken as read (q - 16 from 8) are far off
    signed = jnp.einsum("mk,nk->mn", x.astype(jnp.float32),
                        (w4.as_int4(wu8).astype(jnp.float32) - jnp.repeat(z, G, 1))
                        * jnp.repeat(s, G, 1))
    assert float(jnp.max(jnp.abs(signed - want))) > 0.1 * scale


@pytest.mark.parametrize("m,n,k,settings", [
    (1, 128, 512, {}),
    (5, 256, 1024, dict(k_splits=2)),
    (16, 128, 1024, dict(k_splits=2, tile_n=64)),
    (33, 64, 512, dict(tile_n=64, stages=2)),
    (64, 128, 1536, dict(k_splits=3)),
    (5, 256, 1024, dict(k_splits=2, early_scales=True)),
    (16, 128, 2048, dict(k_splits=4, early_scales=True, out_rows=True)),
], ids=str)
def test_kernel_matches_twin_interpret(m, n, k, settings):
    wu8, s, z = _checkpoint(n, k, seed=m)
    args = (_x(m, k, seed=m + 1), w4.as_int4(wu8), s, z)
    got = w4.w4a16_matmul(*args, out_dtype=jnp.float32, interpret=True, **settings)
    want = w4.ref_w4a16_matmul(*args, out_dtype=jnp.float32)
    assert got.shape == (m, n)
    # the same bf16 weights; only the order of the f32 sums differs
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-4 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("rows", [False, True], ids=["column", "rows"])
def test_both_scale_reads_interpret(monkeypatch, rows):
    """A step reads its group's scales as the slab's column (jax 0.10) or as a row of
    the slab stored transposed (jax 0.11, where CI cannot lower it): both give the
    twin's numbers, with the scales made ready before the pipeline or in its first
    step (early_scales)."""
    monkeypatch.setattr(w4, "ROWS", rows)
    w4.w4a16_matmul.clear_cache()       # else the other case's trace serves this one
    wu8, s, z = _checkpoint(128, 1024, seed=7)
    args = (_x(16, 1024, seed=8), w4.as_int4(wu8), s, z)
    want = w4.ref_w4a16_matmul(*args, out_dtype=jnp.float32)
    for early in (False, True):
        got = w4.w4a16_matmul(*args, out_dtype=jnp.float32, interpret=True, k_splits=2,
                              early_scales=early)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                   atol=1e-4 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("m,splits", [(3, 2), (16, 4), (40, 1)])
def test_both_output_layouts_interpret(m, splits):
    """The partials written [S, N, Mp] or [S, Mp, N] (out_rows: the tile stored
    transposed) sum to the twin's numbers, also for rows below Mp."""
    wu8, s, z = _checkpoint(256, 2048, seed=9)
    args = (_x(m, 2048, seed=10), w4.as_int4(wu8), s, z)
    want = w4.ref_w4a16_matmul(*args, out_dtype=jnp.float32)
    for out_rows in (False, True):
        got = w4.w4a16_matmul(*args, out_dtype=jnp.float32, interpret=True, k_splits=splits,
                              out_rows=out_rows)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                   atol=1e-4 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("m,n,k,settings", [(5, 256, 1024, dict(k_splits=2)),
                                             (16, 256, 2048, dict(tile_n=64, k_splits=4))],
                         ids=str)
def test_tiled_weight_interpret(m, n, k, settings):
    """The weight stored tiled (each step's tile one contiguous block): the same bytes
    rearranged, tiled from the bytes or from int4 alike, and the kernel's result on it
    equals its result on [N, K] exactly and the twin's on either."""
    wu8, s, z = _checkpoint(n, k, seed=11)
    tn = settings.get("tile_n", 128)
    q, qt = w4.as_int4(wu8), w4.as_int4(w4.tile_weight(wu8, tn))
    assert qt.shape == (n // tn, k // G, tn, G)
    np.testing.assert_array_equal(np.asarray(w4.tile_weight(q, tn)), np.asarray(qt))
    np.testing.assert_array_equal(np.asarray(w4.untile_weight(qt)), np.asarray(q))
    # tile (i, j) is the weight's rows i*TN.. and group j's columns
    np.testing.assert_array_equal(np.asarray(qt[1, 2]), np.asarray(q[tn:2 * tn, 2 * G:3 * G]))
    x = _x(m, k, seed=12)
    plain = w4.w4a16_matmul(x, q, s, z, out_dtype=jnp.float32, interpret=True, **settings)
    got = w4.w4a16_matmul(x, qt, s, z, out_dtype=jnp.float32, interpret=True, **settings)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
    want = w4.ref_w4a16_matmul(x, qt, s, z, out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(want),
                                  np.asarray(w4.ref_w4a16_matmul(x, q, s, z,
                                                                 out_dtype=jnp.float32)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-4 * float(jnp.max(jnp.abs(want))))
    with pytest.raises(ValueError, match="tiled for tile_n 64"):   # tiled for 128
        w4.w4a16_matmul(x, w4.as_int4(w4.tile_weight(wu8, 128)), s, z, tile_n=64)


@pytest.mark.parametrize("gps,splits", [(2, 2), (4, 1)])
def test_groups_per_step_interpret(gps, splits):
    """Stages of 2 or 4 groups (each TMA copy reading 128 or 256 bytes of a row), one
    wgmma a group: the twin's numbers, at 1 and 2 stages' worth of steps a split."""
    wu8, s, z = _checkpoint(256, 1024, seed=13)
    args = (_x(5, 1024, seed=14), w4.as_int4(wu8), s, z)
    want = w4.ref_w4a16_matmul(*args, out_dtype=jnp.float32)
    got = w4.w4a16_matmul(*args, out_dtype=jnp.float32, interpret=True, k_splits=splits,
                          groups_per_step=gps, stages=2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-4 * float(jnp.max(jnp.abs(want))))
    for bad in (3, 8):
        with pytest.raises(ValueError, match="groups_per_step"):
            w4.w4a16_matmul(*args, k_splits=splits, groups_per_step=bad)


def test_call_sites_share_one_trace(monkeypatch):
    """A model calls the kernel once per layer and projection (128 call sites a decode
    step of an 8B model); each site lowered and compiled on its own took ~0.9 s on the
    GPU machine. Calls of one shape must share one trace, hence one lowering."""
    traced = []
    real = w4._call
    monkeypatch.setattr(w4, "_call", lambda *a, **kw: traced.append(1) or real(*a, **kw))
    w4.w4a16_matmul.clear_cache()                     # a trace earlier tests left
    wu8, s, z = _checkpoint(512, 512)
    q = w4.as_int4(wu8)

    def layers(x):
        for _ in range(3):
            x = x + w4.w4a16_matmul(x, q, s, z)[:, :512].astype(x.dtype)
        return x

    jax.make_jaxpr(layers)(_x(16, 512))
    assert len(traced) == 1


def test_bad_operands_are_refused():
    wu8, s, z = _checkpoint(128, 512)
    q = w4.as_int4(wu8)
    with pytest.raises(ValueError, match="int4"):
        w4.w4a16_matmul(_x(4, 512), wu8, s, z)
    with pytest.raises(ValueError, match="scale"):
        w4.w4a16_matmul(_x(4, 512), q, s[:, :1], z[:, :1])
    with pytest.raises(ValueError, match="M 65"):
        w4.w4a16_matmul(_x(65, 512), q, s, z)
    with pytest.raises(ValueError, match="k_splits"):
        w4.w4a16_matmul(_x(4, 512), q, s, z, k_splits=2)


def test_default_splits_cover_the_sms_in_whole_slabs():
    """The 8B projections: programs at least four times the 132 SMs at 16 rows and twice
    above, 4 groups a split or more, a program within shared memory at its rows."""
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        for mp, times in ((16, 4), (32, 2), (64, 2)):
            stages = w4.default_stages(mp)
            s = w4.default_k_splits(n, k, 128, mp, stages)
            assert (k // G) % s == 0 and (k // G // s) % 4 == 0
            assert n // 128 * s >= times * 132 or (k // G // s) == 4, (n, k, mp, s)
            smem = w4.smem_bytes(128, mp, k // G // s, stages)
            assert smem <= w4.common.SMEM_BYTES
            # at least two programs an SM (228 KiB on Hopper, 1 KiB reserved a program):
            # with 4 stages above 16 rows gate/up and down fit one
            assert 2 * (smem + 1024) <= 228 * 1024, (n, k, mp, stages)
    # gate/up: 224 tiles, 4 splits at 16 rows (896 programs), 2 above (448)
    assert [w4.default_k_splits(28672, 4096, 128, mp, w4.default_stages(mp))
            for mp in (16, 64)] == [4, 2]
    assert w4.smem_bytes(128, 64, 16, 4) + 1024 > 114 * 1024   # 4 stages: one an SM
    assert not w4.supported(4096, 128 * 6)      # 6 groups: no split of whole 4-group slabs
    # 128 groups in one split: the slabs alone push a program past shared memory, so
    # the default splits further (the fewest that fit: 2)
    assert [w4.default_k_splits(128 * 1024, 128 * 128, 128, mp) for mp in (16, 64)] == [2, 2]
    with pytest.raises(ValueError, match="shared memory"):
        wu8, s, z = _checkpoint(128, 128 * 128)
        w4.w4a16_matmul(_x(64, 128 * 128), w4.as_int4(wu8), s, z, k_splits=1, stages=8)


SD = jax.ShapeDtypeStruct


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_lowers_for_cuda(m, n, k):
    """Every Llama-3.1-8B projection at decode sizes: Mosaic's layout inference and
    lowering run here, so a kernel the GPU cannot lower fails CI."""
    args = (SD((m, k), jnp.bfloat16), SD((n, k), jnp.int4), SD((n, k // G), jnp.float32),
            SD((n, k // G), jnp.float32))
    text = lower_for_cuda(w4.w4a16_matmul, *args)
    assert "mosaic_gpu" in text
    # x goes to the kernel as it is, its tiles read past M (TMA fills zeros): no pad;
    # by default on jax >= 0.11 the partials come out [S, Mp, N], with no transpose
    assert "stablehlo.pad" not in text
    assert ("stablehlo.transpose" in text) != (w4.OUT_ROWS and w4.ROWS)
    # the first step waiting for the scales; on jax >= 0.11 the partials [S, Mp, N] too
    # (their tile stored transposed), which leaves no transpose to XLA
    kw = dict(early_scales=True, out_rows=w4.ROWS)
    text = lower_for_cuda(functools.partial(w4.w4a16_matmul, **kw), *args)
    assert "mosaic_gpu" in text and ("stablehlo.transpose" in text) != w4.ROWS
    # the weight stored tiled: its step tiles are 4-d TMA boxes of contiguous bytes
    tiled = (args[0], SD((n // 128, k // G, 128, G), jnp.int4), *args[2:])
    assert "mosaic_gpu" in lower_for_cuda(w4.w4a16_matmul, *tiled)
    # two groups a stage: a stage's tiles sliced per group at the swizzle tiles' seams
    two = functools.partial(w4.w4a16_matmul, groups_per_step=2, stages=2)
    assert "mosaic_gpu" in lower_for_cuda(two, *args)
