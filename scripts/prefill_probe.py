"""Where the ragged prefill kernel's time goes, against cuDNN, at 8 x 2048 causal.

Each variant changes one thing in the kernel and is timed in the same process as
cuDNN's `jax.nn.dot_product_attention` on the same (non-paged) shapes:

  base     the kernel as shipped (one block-table read per pool block), at several
           settings
  contig   key addresses from the sequence's first block (no block-table read in the
           loop): the price of the paging indirection (valid here: each sequence's
           blocks are contiguous in the pool)
  perkey   the block table read once per key (the kernel before 2026-12-01's fourth
           session: 1.156 ms against 0.754 per block at block_q=64, 8 warps, 3 stages)
  fma      the softmax scale folded into exp2's argument (one FMA per score)
  flat     one query head per program (FlashAttention-2's layout, M = block_q
           tokens) instead of the G heads of a KV head packed into the rows

    python scripts/prefill_probe.py [--decode] [--small]

GPU only. --decode: the decode kernel instead, per-block against per-key
block-table reads, bf16 and fp8 KV, at its default split count and at one split (the
decode kernel ships per key: 2026-12-01, per block was slower with fp8 and at B=8).
--small: short prompts (a latency benchmark's prefill), the ragged kernel at its old
and new settings, alone and behind the backend's decode split.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_kernels as bk  # noqa: E402
from pallas_kernels import common  # noqa: E402
import pallas_kernels.ragged_paged_attention as rpa  # noqa: E402

ORIG_TILE_SLOTS = common.tile_slots


def perblock_slots(*args, **kw):
    return ORIG_TILE_SLOTS(*args, **dict(kw, per_block=True))


def contig_slots(bt_ref, seq, first, *, tile, block_size, per_block=False):
    return bt_ref[seq, 0] * block_size + first + jnp.arange(tile)


def perkey_slots(bt_ref, seq, first, *, tile, block_size, per_block=False):
    kpos = first + jnp.arange(tile)
    col = jnp.minimum(lax.div(kpos, block_size), bt_ref.shape[1] - 1)
    return bt_ref[seq, col] * block_size + lax.rem(kpos, block_size)


ORIG_SOFTMAX_STEP = common.softmax_step


def fma_softmax_step(q, k, v, mask, carry, scale2):
    """softmax_step with the scale folded into the exponent's FMA (no separate multiply)."""
    m, l, acc = carry
    s = common.plgpu.dot(q, k, trans_b=True)
    if mask is not None:
        s = jnp.where(mask, s, common.MASK)
    m_new = jnp.maximum(m, s.max(axis=1) * scale2)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s * scale2 - m_new[:, None])
    l = l * alpha + p.sum(axis=1)
    acc = acc * alpha[:, None] + common.plgpu.dot(p.astype(v.dtype), v)
    return m_new, l, acc


def flat_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                   sm_scale, block_q=64, blocks_per_step=4, num_warps=4, num_stages=2,
                   interpret=False):
    num_tokens, hq, d = q.shape
    hkv, nb, bs, _ = k_cache.shape
    g = hq // hkv
    tiles = rpa.tile_schedule(query_start_loc, seq_lens, num_tokens, block_q)
    kernel = functools.partial(_flat_kernel, hq=hq, d=d, bs=bs, block_q=block_q,
                               tile=blocks_per_step * bs, scale2=sm_scale * common.LOG2E)
    pool_spec = pl.BlockSpec((None, nb * bs, d), lambda t, h: (h // g, 0, 0))
    full = lambda x: pl.BlockSpec(x.shape, lambda t, h: (0,) * x.ndim)  # noqa: E731
    q2 = q.reshape(num_tokens * hq, d)
    out = common.pallas_call(
        kernel, grid=(tiles.shape[0], hq),
        in_specs=[full(tiles), full(block_tables), full(q2), pool_spec, pool_spec],
        out_specs=full(q2), out_shape=jax.ShapeDtypeStruct(q2.shape, q.dtype),
        num_warps=num_warps, num_stages=num_stages, interpret=interpret, name="flat_probe",
    )(tiles, block_tables, q2, k_cache.reshape(hkv, nb * bs, d),
      v_cache.reshape(hkv, nb * bs, d))
    return out.reshape(num_tokens, hq, d)


def _flat_kernel(tiles_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *, hq, d, bs, block_q,
                 tile, scale2):
    t, h = pl.program_id(0), pl.program_id(1)
    seq, tok0, ntok, pos0, kvlen = (tiles_ref[t, f] for f in range(5))
    tok = jnp.arange(block_q)
    row_ok = tok < ntok
    rows = jnp.where(row_ok, (tok0 + tok) * hq + h, 0)
    qpos = pos0 + tok

    @pl.when(ntok > 0)
    def _():
        q = common.load_rows(q_ref, rows, d, d, row_ok)
        hi = jnp.clip(pos0 + ntok, 0, kvlen)
        end = common.cdiv(hi, tile)
        full_end = jnp.clip(lax.div(pos0 + 1, tile), 0, end)

        def masked_step(i, carry):
            kpos, kvalid, k, v = common.kv_tile(
                bt_ref, k_ref, v_ref, seq, i * tile, tile=tile, block_size=bs, d=d, dp=d,
                kv_mask_fn=lambda kpos: kpos < hi, dtype=q.dtype)
            mask = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
            return common.softmax_step(q, k, v, mask, carry, scale2)

        carry = common.unmasked_loop(bt_ref, k_ref, v_ref, seq, 0, full_end, q,
                                     common.init_carry(block_q, d), tile=tile,
                                     block_size=bs, d=d, dp=d, scale2=scale2)
        _, l, acc = lax.fori_loop(full_end, end, masked_step, carry)
        out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
        common.store_rows(o_ref, rows, out, d, row_ok)


BASE = [dict(block_q=b, blocks_per_step=p, num_warps=w, num_stages=s) for b, p, w, s in (
    (32, 4, 4, 2), (32, 4, 4, 3), (32, 2, 4, 2), (32, 2, 4, 3), (32, 2, 4, 4),
    (32, 8, 8, 2), (32, 8, 8, 3), (64, 4, 8, 2), (64, 4, 8, 3), (64, 2, 8, 3),
    (64, 8, 8, 2), (16, 4, 4, 3), (16, 8, 4, 2))]
SHORT = [dict(block_q=32, blocks_per_step=4, num_warps=4, num_stages=2),
         dict(block_q=32, blocks_per_step=8, num_warps=8, num_stages=3),
         dict(block_q=64, blocks_per_step=4, num_warps=8, num_stages=3)]
FLAT = [dict(block_q=b, blocks_per_step=p, num_warps=w, num_stages=s) for b, p, w, s in (
    (64, 4, 4, 2), (64, 4, 4, 3), (128, 4, 4, 2), (128, 4, 8, 2), (128, 4, 8, 3),
    (128, 8, 8, 2), (128, 8, 8, 3), (64, 8, 4, 3))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--only", default="base,contig,perkey,fma,flat")
    args = ap.parse_args()
    if args.decode:
        return decode_ab()
    if args.small:
        return small_prompts()
    q, k, v, kc, vc, tables, lens, qsl, _ = bk.ragged_inputs(8, 2048)
    n, prompt = lens.shape[0], q.shape[0] // lens.shape[0]
    flops = 4 * n * bk.HQ * prompt * prompt // 2 * bk.D
    qb, kb, vb = (x.reshape(n, prompt, -1, bk.D) for x in (q, k, v))
    cudnn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                      scale=bk.SM_SCALE, implementation="cudnn"))
    want = np.asarray(cudnn(qb, kb, vb), np.float32).reshape(q.shape)
    rows = []

    def one(name, fn):
        rec = {"variant": name}
        try:
            got = np.asarray(fn(q, kc, vc, tables, lens, qsl), np.float32)
            rec["err"] = float(np.abs(got - want).max() / np.abs(want).max())
            rec["ms"] = bk.bench(fn, q, kc, vc, tables, lens, qsl, budget_s=0.15, repeats=5) * 1e3
            rec["TFLOP/s"] = flops / rec["ms"] / 1e9
        except Exception as e:  # noqa: BLE001 - one row must not lose the table
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
        rows.append(rec)
        print(json.dumps(rec), flush=True)

    ms = bk.bench(cudnn, qb, kb, vb) * 1e3
    rows.append({"variant": "cudnn", "ms": ms, "TFLOP/s": flops / ms / 1e9})
    print(json.dumps(rows[-1]), flush=True)
    only = args.only.split(",")
    for variant, slots, step, configs in (
            ("base", ORIG_TILE_SLOTS, ORIG_SOFTMAX_STEP, BASE),
            ("contig", contig_slots, ORIG_SOFTMAX_STEP, SHORT),
            ("perkey", perkey_slots, ORIG_SOFTMAX_STEP, SHORT),
            ("fma", ORIG_TILE_SLOTS, fma_softmax_step, SHORT)):
        if variant not in only:
            continue
        common.tile_slots, common.softmax_step = slots, step
        jax.clear_caches()
        for cfg in configs:
            one(f"{variant} " + " ".join(f"{k}={v}" for k, v in cfg.items()),
                jax.jit(functools.partial(rpa.ragged_paged_attention, sm_scale=bk.SM_SCALE,
                                          **cfg)))
    common.tile_slots, common.softmax_step = ORIG_TILE_SLOTS, ORIG_SOFTMAX_STEP
    jax.clear_caches()
    if "flat" in only:
        for cfg in FLAT:
            one("flat " + " ".join(f"{k}={v}" for k, v in cfg.items()),
                jax.jit(functools.partial(flat_attention, sm_scale=bk.SM_SCALE, **cfg)))
    print(f"\n{'variant':<62} {'ms':>8} {'TFLOP/s':>8} {'x cuDNN':>8} {'err':>9}")
    for r in rows:
        if "ms" in r:
            print(f"{r['variant']:<62} {r['ms']:8.3f} {r['TFLOP/s']:8.1f} "
                  f"{r['ms'] / ms:8.2f} {r.get('err', 0):9.2e}")
        else:
            print(f"{r['variant']:<62} {r['error']}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "prefill_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)


def compare_all_schedule(query_start_loc, seq_lens, num_tokens, block_q):
    """tile_schedule with searchsorted as one broadcast compare (no while loop)."""
    orig = jnp.searchsorted
    jnp.searchsorted = functools.partial(orig, method="compare_all")
    try:
        return ORIG_SCHEDULE(query_start_loc, seq_lens, num_tokens, block_q)
    finally:
        jnp.searchsorted = orig


ORIG_SCHEDULE = rpa.tile_schedule


def small_prompts():
    import pallas_kernels.dispatch as dispatch
    old = dict(block_q=32, blocks_per_step=4, num_warps=4, num_stages=2)
    rows = []
    for n, prompt in ((8, 32), (1, 128), (8, 128), (4, 512), (16, 512), (2, 2048)):
        q, _, _, kc, vc, tables, lens, qsl, _ = bk.ragged_inputs(n, prompt)
        for name, split, cfg, sched in (
                ("schedule only", None, None, ORIG_SCHEDULE),
                ("schedule cmp", None, None, compare_all_schedule),
                ("ragged old", False, old, ORIG_SCHEDULE),
                ("ragged new", False, {}, ORIG_SCHEDULE),
                ("ragged new cmp", False, {}, compare_all_schedule),
                ("split old", True, old, ORIG_SCHEDULE),
                ("split new", True, {}, ORIG_SCHEDULE),
                ("split new cmp", True, {}, compare_all_schedule)):
            rpa.tile_schedule = sched
            dispatch.ragged_paged_attention = functools.partial(
                rpa.ragged_paged_attention, **(cfg or {}))
            jax.clear_caches()
            if split is None:
                f = jax.jit(lambda q, kc, vc, t, l, s: sched(s, l, q.shape[0], 64))
            elif split:
                f = jax.jit(functools.partial(dispatch.mixed_step_attention,
                                              sm_scale=bk.SM_SCALE))
            else:
                f = jax.jit(functools.partial(rpa.ragged_paged_attention,
                                              sm_scale=bk.SM_SCALE, **cfg))
            sec = bk.bench(f, q, kc, vc, tables, lens, qsl, budget_s=0.1, repeats=5)
            rows.append(dict(seqs=n, prompt=prompt, variant=name, us=sec * 1e6))
            print(json.dumps(rows[-1]), flush=True)
    rpa.tile_schedule = ORIG_SCHEDULE
    print(f"\n{'seqs':>5} {'prompt':>6} {'variant':>15} {'us':>9}")
    for r in rows:
        print(f"{r['seqs']:>5} {r['prompt']:>6} {r['variant']:>15} {r['us']:9.1f}")


def decode_ab():
    from pallas_kernels.paged_attention_decode import paged_attention_decode
    shapes = [(64, 2048, jnp.bfloat16), (64, 2048, jnp.float8_e4m3fn), (8, 512, jnp.bfloat16),
              (8, 8192, jnp.bfloat16), (1, 8192, jnp.bfloat16), (256, 8192, jnp.bfloat16)]
    rows = []
    for batch, ctx, dtype in shapes:
        q, k, v, tables, lens, kv_bytes = bk.decode_inputs(batch, ctx, dtype)
        for splits in (None, 1):
            for name, slots in (("perblock", perblock_slots), ("perkey", perkey_slots)):
                common.tile_slots = slots
                jax.clear_caches()
                kw = {} if splits is None else dict(k_splits=splits)
                fn = jax.jit(functools.partial(paged_attention_decode, sm_scale=bk.SM_SCALE,
                                               **kw))
                sec = bk.bench(fn, q, k, v, tables, lens)
                rows.append(dict(batch=batch, ctx=ctx, kv=jnp.dtype(dtype).name,
                                 splits=splits or "default", slots=name, ms=sec * 1e3,
                                 tbs=kv_bytes / sec / 1e12))
                print(json.dumps(rows[-1]), flush=True)
    common.tile_slots = ORIG_TILE_SLOTS
    print(f"\n{'batch':>5} {'ctx':>5} {'kv':>14} {'splits':>8} {'slots':>9} {'ms':>7} {'TB/s':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['ctx']:>5} {r['kv']:>14} {r['splits']:>8} {r['slots']:>9} "
              f"{r['ms']:7.3f} {r['tbs']:6.2f}")


if __name__ == "__main__":
    main()
