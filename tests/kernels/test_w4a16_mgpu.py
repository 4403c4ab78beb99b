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


def _args(m, n, k, seed):
    """(x, int4 weight, packed scales) of a random checkpoint."""
    wu8, s, z = _checkpoint(n, k, seed=seed)
    return _x(m, k, seed=seed + 1), w4.as_int4(wu8), w4.pack_scales(s, z)


def test_twin_matches_the_checkpoint_reference():
    """The twin on packed scales computes what the checkpoint's weights mean, to the
    bf16 rounding of the scales and the widened weight."""
    wu8, s, z = _checkpoint(64, 512)
    x = _x(4, 512)
    want = qmm.ref_quant_matmul_int4(x, wu8, s, z, group=G, out_dtype=jnp.float32)
    got = w4.ref_w4a16_matmul(x, w4.as_int4(wu8), w4.pack_scales(s, z), out_dtype=jnp.float32)
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(got - want))) < 5e-3 * scale
    # and not by accident: the uint4 values taken as read (q - 16 from 8) are far off
    signed = jnp.einsum("mk,nk->mn", x.astype(jnp.float32),
                        (w4.as_int4(wu8).astype(jnp.float32) - jnp.repeat(z, G, 1))
                        * jnp.repeat(s, G, 1))
    assert float(jnp.max(jnp.abs(signed - want))) > 0.1 * scale


def test_pack_scales_layout():
    """bf16 [2 K/G, N]: row 2j group j's scales (rounded to bf16), row 2j + 1 its zero
    points (exact); unpack_scales gives them back as f32 [N, K/G]."""
    _, s, z = _checkpoint(256, 12 * G, seed=15)
    packed = w4.pack_scales(s, z)
    assert packed.shape == (24, 256) and packed.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(packed[5], np.float32), np.asarray(z[:, 2]))
    np.testing.assert_array_equal(np.asarray(packed[4]),
                                  np.asarray(s[:, 2].astype(jnp.bfloat16)))
    back_s, back_z = w4.unpack_scales(packed)
    np.testing.assert_array_equal(np.asarray(back_z), np.asarray(z))
    np.testing.assert_array_equal(np.asarray(back_s),
                                  np.asarray(s.astype(jnp.bfloat16).astype(jnp.float32)))


@pytest.mark.parametrize("m,n,k,settings", [
    (1, 128, 512, {}),
    (5, 256, 1024, dict(k_splits=2)),
    (16, 128, 1024, dict(k_splits=2, tile_n=64)),
    (33, 64, 512, dict(tile_n=64, stages=2)),
    (64, 128, 1536, dict(k_splits=3)),
    (16, 128, 2048, dict(k_splits=4, out_rows=True)),
    (1, 256, 12 * G, dict(k_splits=4)),           # splits of 3 groups
    (40, 256, 12 * G, dict(k_splits=6)),          # and of 2
    (3, 128, 1024, dict(groups_per_step=2, k_splits=2)),
    (16, 256, 2048, dict(groups_per_step=4, k_splits=2)),
    (2, 128, 64 * G, {}),     # the defaults: 8 splits of 8 groups, 2 a stage, 2 stages
    # a program streaming several tiles through one pipeline (the accumulator written
    # out and zeroed at each tile's last step)
    (3, 512, 1024, dict(tiles=2, k_splits=2)),
    (16, 512, 2048, dict(tiles=4, k_splits=2, groups_per_step=2, stages=2)),
    (5, 384, 1024, dict(tiles=3, k_splits=1, out_rows=False)),
], ids=str)
def test_kernel_matches_twin_interpret(m, n, k, settings):
    args = _args(m, n, k, seed=m)
    got = w4.w4a16_matmul(*args, out_dtype=jnp.float32, interpret=True, **settings)
    want = w4.ref_w4a16_matmul(*args, out_dtype=jnp.float32)
    assert got.shape == (m, n)
    # the same bf16 weights; only the order of the f32 sums differs
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=1e-4 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("m,splits", [(3, 2), (16, 4), (40, 1)])
def test_both_output_layouts_interpret(m, splits):
    """The partials written [S, N, Mp] or [S, M, N] (out_rows: the tile stored
    transposed, only x's M rows of it copied out) sum to the twin's numbers, also for
    rows below Mp."""
    args = _args(m, 256, 2048, seed=9)
    want = w4.ref_w4a16_matmul(*args, out_dtype=jnp.float32)
    for out_rows in (False, True):
        got = w4.w4a16_matmul(*args, out_dtype=jnp.float32, interpret=True, k_splits=splits,
                              out_rows=out_rows)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                   atol=1e-4 * float(jnp.max(jnp.abs(want))))


def test_call_sites_share_one_trace(monkeypatch):
    """A model calls the kernel once per layer and projection (128 call sites a decode
    step of an 8B model); each site lowered and compiled on its own took ~0.9 s on the
    GPU machine. Calls of one shape must share one trace, hence one lowering."""
    traced = []
    real = w4._call
    monkeypatch.setattr(w4, "_call", lambda *a, **kw: traced.append(1) or real(*a, **kw))
    w4.w4a16_matmul.clear_cache()                     # a trace earlier tests left
    _, q, sz = _args(16, 512, 512, seed=0)

    def layers(x):
        for _ in range(3):
            x = x + w4.w4a16_matmul(x, q, sz)[:, :512].astype(x.dtype)
        return x

    jax.make_jaxpr(layers)(_x(16, 512))
    assert len(traced) == 1


def test_bad_operands_are_refused():
    wu8, s, z = _checkpoint(128, 512)
    q, sz = w4.as_int4(wu8), w4.pack_scales(s, z)
    with pytest.raises(ValueError, match="int4"):
        w4.w4a16_matmul(_x(4, 512), wu8, sz)
    with pytest.raises(ValueError, match=r"scales \(128, 4\): packed \[8, 128\]"):
        w4.w4a16_matmul(_x(4, 512), q, s)            # the checkpoint's f32 [N, K/G]
    with pytest.raises(ValueError, match=r"packed \[8, 128\]"):
        w4.w4a16_matmul(_x(4, 512), q, sz.T)
    with pytest.raises(ValueError, match="M 65"):
        w4.w4a16_matmul(_x(65, 512), q, sz)
    with pytest.raises(ValueError, match="k_splits 3: must divide K's 4 groups"):
        w4.w4a16_matmul(_x(4, 512), q, sz, k_splits=3)
    with pytest.raises(ValueError, match="groups_per_step 0: 1, 2 or 4"):
        w4.w4a16_matmul(_x(4, 512), q, sz, k_splits=1, groups_per_step=0)
    with pytest.raises(ValueError, match="groups_per_step 3: 1, 2 or 4"):
        w4.w4a16_matmul(_x(4, 512), q, sz, k_splits=1, groups_per_step=3)
    with pytest.raises(ValueError, match="splits of a multiple of 4 groups"):
        w4.w4a16_matmul(_x(4, 512), q, sz, k_splits=2, groups_per_step=4)
    with pytest.raises(ValueError, match="tiles 3: must divide N's 1 tiles"):
        w4.w4a16_matmul(_x(4, 512), q, sz, tiles=3)
    with pytest.raises(ValueError, match="tiles 0: must divide"):
        w4.w4a16_matmul(_x(4, 512), q, sz, tiles=0, k_splits=1)
    with pytest.raises(ValueError, match="K's 2 groups: no default split of at least 4"):
        w4.w4a16_matmul(*_args(4, 128, 256, seed=0))


def test_default_splits():
    """The 8B projections: up to 16 rows the most splits up to 8, above 16 rows
    programs at least twice the 132 SMs; 4 groups a split or more, a program within
    shared memory at its rows."""
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        for mp in (16, 32, 64):
            stages = w4.default_stages(mp)
            s = w4.default_k_splits(n, k, 128, mp, stages)
            assert (k // G) % s == 0 and k // G // s >= 4
            if mp > 16:
                assert n // 128 * s >= 2 * 132 or (k // G // (s + 1)) < 4, (n, k, mp, s)
            smem = w4.smem_bytes(128, mp, stages)
            assert smem <= w4.common.SMEM_BYTES
            # at least two programs an SM (228 KiB on Hopper, 1 KiB reserved a program):
            # with 4 stages above 16 rows gate/up and down fit one
            assert 2 * (smem + 1024) <= 228 * 1024, (n, k, mp, stages)
    # the splits measured on an H100: 8 for all four at 16 rows (4 groups each, down
    # 14); above, qkv and o 8, gate/up 2, down 14
    got = {(n, k): [w4.default_k_splits(n, k, 128, mp, w4.default_stages(mp))
                    for mp in (16, 64)]
           for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]}
    assert got == {(6144, 4096): [8, 8], (4096, 4096): [8, 8], (28672, 4096): [8, 2],
                   (4096, 14336): [8, 14]}
    # what a call naming no setting takes (the H100 sweep's lead up to 16 rows):
    # gate/up 4 splits (896 programs), gate/up and down 2 groups a stage with 2 stages
    got = {(n, k): [w4.default_settings(n, k, 128, mp) for mp in (16, 64)]
           for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]}
    assert got == {(6144, 4096): [(8, 4, 1), (8, 2, 1)], (4096, 4096): [(8, 4, 1), (8, 2, 1)],
                   (28672, 4096): [(4, 2, 2), (2, 2, 1)],
                   (4096, 14336): [(8, 2, 2), (14, 2, 1)]}
    assert w4.default_settings(128, 64 * G, 128, 16) == (8, 2, 2)
    for mp in (16, 64):     # within shared memory, two programs an SM or more
        for n, k in got:
            splits, stages, gps = w4.default_settings(n, k, 128, mp)
            assert (k // G // splits) % gps == 0
            assert 2 * (w4.smem_bytes(128, mp, stages, gps) + 1024) <= 228 * 1024
    # a K of 6 groups at 16 rows: 1 split (2 of 3 groups fall under 4 a split)
    assert w4.default_k_splits(4096, 6 * G, 128, 16) == 1
    # the kernel's dynamic shared memory in Mosaic's dumps (jax 0.11.2)
    assert [w4.smem_bytes(128, 16, 4), w4.smem_bytes(128, 64, 2)] == [51232, 50192]
    # several tiles a program: the output tile beside the pipeline's, not in its place
    assert w4.smem_bytes(128, 16, 4, tiles=2) == 51232 + 128 * 16 * 4
    # 64 rows: 2 stages leave room for four programs an SM, 4 stages for two
    assert [228 * 1024 // (w4.smem_bytes(128, 64, st) + 1024) for st in (2, 4)] == [4, 2]
    assert w4.supported(4096, 128 * 6) and w4.default_k_splits(4096, 128 * 6, 128) == 1
    assert not w4.supported(4096, 128 * 3)        # no split of at least 4 groups
    with pytest.raises(ValueError, match="shared memory"):
        w4.w4a16_matmul(*_args(64, 128, 128 * 8, seed=0), k_splits=1, stages=12)


SD = jax.ShapeDtypeStruct


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_lowers_for_cuda(m, n, k):
    """Every Llama-3.1-8B projection at decode sizes: Mosaic's layout inference and
    lowering run here, so a kernel the GPU cannot lower fails CI (the packed scales'
    [2, TN] bf16 rows a pipeline step, read with the row layout)."""
    args = (SD((m, k), jnp.bfloat16), SD((n, k), jnp.int4), SD((2 * k // G, n), jnp.bfloat16))
    text = lower_for_cuda(w4.w4a16_matmul, *args)
    assert "mosaic_gpu" in text
    # x goes to the kernel as it is, its tiles read past M (TMA fills zeros): no pad;
    # by default on jax >= 0.11 the partials come out [S, M, N], with no transpose
    assert "stablehlo.pad" not in text
    assert ("stablehlo.transpose" in text) != (w4.OUT_ROWS and w4.ROWS)


@pytest.mark.parametrize("settings", [dict(groups_per_step=2),
                                      dict(groups_per_step=4, stages=2),
                                      dict(k_splits=8, tiles=7),
                                      dict(k_splits=8, tiles=7, groups_per_step=2, stages=3)],
                         ids=str)
def test_settings_lower_for_cuda(settings):
    """Two or four groups a pipeline stage, and several tiles a program, lower for the
    GPU too."""
    args = (SD((16, 4096), jnp.bfloat16), SD((28672, 4096), jnp.int4),
            SD((64, 28672), jnp.bfloat16))
    text = lower_for_cuda(functools.partial(w4.w4a16_matmul, **settings), *args)
    assert "mosaic_gpu" in text
