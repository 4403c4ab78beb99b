"""Decode paged attention: one query token per sequence over the block pool, GQA, with
split-K over the context (flash-decoding) and a combine step.

Letter legend: S sequences, Hq query heads, Hkv KV heads, G = Hq // Hkv, Gp = G padded
to a power of two >= 16 (the M of the dots), D head dim, Dp = D padded to a power of
two, NB pool blocks, BS block size, B blocks per block-table row, NS k-splits,
K = blocks_per_step * BS keys per inner step.

Grid (S, Hkv, NS): a program takes all G query heads of one KV head of one sequence,
so each KV block is read from HBM once. Split ``k`` of a sequence covers an equal share
of *that sequence's* steps (computed in-kernel from ``seq_lens``), so a short sequence
in a wide block table still spreads over all splits. Each split writes its normalized
partial output and log2-sum-exp; the combine is a small fused XLA op.

``spread``: the P programs are shared among the live sequences (seq_lens > 0) instead,
each getting P // live of them (at most ``k_splits``, default SPREAD_SPLITS), in
buckets small enough that the fixed split gives a row more than one program. A step
padded to a sequence bucket (one live sequence in the runner's smallest bucket of 8:
`decode-1`) then gives that sequence twice the programs, each over half the dependent
steps of keys. The plan (spread_plan) is a function of ``seq_lens`` alone, computed
once per model step (every layer's copy is the same HLO).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.ragged_paged_attention import ref_ragged_paged_attention

def ref_paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, *, sm_scale,
                               sliding_window=None, k_scale=1.0, v_scale=1.0,
                               num_q_heads=None):
    """q: [S, Hq, D] (query of sequence s at position seq_lens[s] - 1) -> [S, Hq, D].
    Rows with seq_lens 0 give zeros. ``num_q_heads``: the query heads are the first
    ones of q's (e.g. of a fused [S, Hq + 2 Hkv, D] q/k/v array); default all."""
    num_seqs = q.shape[0]
    q = q[:, :num_q_heads or q.shape[1]]
    qsl = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    return ref_ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl,
                                      sm_scale=sm_scale, sliding_window=sliding_window,
                                      k_scale=k_scale, v_scale=v_scale)


# The most splits ``spread`` gives a row unless k_splits says: the combine's slots. Up to
# 8 XLA keeps combine_splits one fusion; 16 and 32 compile to two for the H200.
SPREAD_SPLITS = 8


def default_k_splits(num_seqs, num_kv_heads, max_steps):
    """About one wave of programs on the card (its SM count, ``common.num_sms``), but
    >= 2 steps per split.

    In the Llama-3.1-8B decode step on the H200 (8 KV heads, block tables 2048 tokens
    wide): at 8 sequences 4 splits beat the 16 that a target of 8 waves gives (4.21 /
    4.49 / 4.77 ms against 4.33 / 4.57 / 4.84 ms at contexts 100 / 1000 / 2000), and
    at 64 sequences 1 split beats 4 (6.98 against 7.15 ms at context 1000): each split
    costs a partial-output write and the combine kernels, more than the idle SMs
    save."""
    want = common.next_pow2(common.cdiv(common.num_sms(), num_seqs * num_kv_heads))
    return max(1, min(want, max_steps // 2))


def default_dot_dtype(q_dtype, kv_dtype):
    """The dtype both dots run in: f16 for fp8 KV under a 16-bit query, else q's.

    Triton on sm90 widens e4m3 to f16 with one packed ``cvt.rn.f16x2.e4m3x2`` per two
    values, but to bf16 with that and a ``cvt.bf16.f16`` per value: 1.5 conversions per
    KV element on the slow conversion pipe. At B=64 ctx 8192 on the H200 (128 keys x 3
    stages) fp8 KV took 0.461 ms with bf16 dots and 0.318 ms with f16 ones, against
    0.520 ms for bf16 KV (scripts/bench_fp8_kv.py). f16 holds every e4m3 value exactly
    and rounds the query finer than bf16 does; the query is scaled by sm_scale *
    log2(e) first, so f16's range (65504) is not the limit."""
    if common.is_fp8(kv_dtype) and jnp.dtype(q_dtype).itemsize == 2:
        return jnp.dtype(jnp.float16)
    return jnp.dtype(q_dtype)


def default_settings(dp: int, bs: int, kv_itemsize: int) -> tuple[int, int]:
    """(blocks_per_step, num_stages) within the shared-memory budget
    (common.fit_kv_pipeline): the tuned 64 keys x 2 stages, and for fp8 KV 128 keys x
    3 stages. Half the bytes per key want more of them in flight: at B=64 ctx 8192 on
    the H200 (f16 dots, 4 warps) fp8 took 0.571 ms at 64 x 2, 0.380 at 64 x 3, 0.347
    at 128 x 2, 0.320 at 128 x 3, 0.321 at 128 x 4 and 0.488 at 256 x 2; at ctx 2048
    0.155 at 64 x 2 and 0.093-0.095 at 128 x 2 / 3 / 4 (scripts/bench_fp8_kv.py)."""
    if kv_itemsize == 1:
        return common.fit_kv_pipeline(bs, max(1, 128 // bs), dp, kv_itemsize, 3)
    return common.fit_kv_pipeline(bs, max(1, 64 // bs), dp, kv_itemsize, 2)


def paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, **kw):
    """Same contract as ``ref_paged_attention_decode``; the rest are kernel settings
    (``per_block``: common.tile_slots; ``dot_dtype``: default_dot_dtype; ``spread``:
    the module docstring, with ``k_splits`` the most splits a sequence gets).
    With ``num_q_heads`` the kernel reads the query rows in place (no slice copy)."""
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, None, **kw)[0]


def ref_decode_and_write(qkv, k_cache, v_cache, block_tables, seq_lens, slot_mapping, *,
                         num_q_heads, sm_scale, sliding_window=None, k_scale=1.0,
                         v_scale=1.0):
    """The KV write, then decode, on a fused qkv [S, Hq + 2 Hkv, D] (the q heads, then
    the k and the v heads): this step's keys and values go into the pool at
    slot_mapping (reshape_and_cache's contract), then each sequence's query attends.
    Returns (out [S, Hq, D], k_cache, v_cache)."""
    from pallas_kernels.reshape_and_cache import ref_reshape_and_cache
    hkv = k_cache.shape[0]
    k_cache, v_cache = ref_reshape_and_cache(
        qkv, qkv, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        head_offsets=(num_q_heads, num_q_heads + hkv))
    out = ref_paged_attention_decode(qkv, k_cache, v_cache, block_tables, seq_lens,
                                     sm_scale=sm_scale, sliding_window=sliding_window,
                                     k_scale=k_scale, v_scale=v_scale,
                                     num_q_heads=num_q_heads)
    return out, k_cache, v_cache


def decode_and_write(qkv, k_cache, v_cache, block_tables, seq_lens, slot_mapping, *,
                     num_q_heads, **kw):
    """``ref_decode_and_write``'s contract in one kernel: the program whose split holds
    a sequence's newest key writes that key and value into the pool (the pool is
    aliased to the output, as in reshape_and_cache) and attends to them from the qkv
    rows, not from the pool, so no other kernel writes them first. Same settings as
    paged_attention_decode.

    Precondition: no row reads a slot another row writes in this call (each row's
    newest key is its own). Rows sharing blocks that one of them fills now (the rows of
    a speculative verify step; a request admitted in this step whose prefix-cache hit
    is a block another row completes) would race; the runner sends such steps down
    the separate write (input_batch.decode_rows_independent)."""
    return _decode(qkv, k_cache, v_cache, block_tables, seq_lens, slot_mapping,
                   num_q_heads=num_q_heads, **kw)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "k_scale", "v_scale", "num_q_heads", "blocks_per_step",
    "k_splits", "num_warps", "num_stages", "per_block", "dot_dtype", "spread", "interpret"))
def _decode(q, k_cache, v_cache, block_tables, seq_lens, slot_mapping, *, sm_scale,
            sliding_window=None, k_scale=1.0, v_scale=1.0, num_q_heads=None,
            blocks_per_step=None, k_splits=None, num_warps=4, num_stages=None,
            per_block=False, dot_dtype=None, spread=False, interpret=False):
    """(out, k_cache, v_cache), the pools written, when slot_mapping is given; else
    (out, None, None)."""
    write = slot_mapping is not None
    num_seqs, q_stride, d = q.shape
    hq = num_q_heads or q_stride
    hkv, nb, bs, _ = k_cache.shape
    g = hq // hkv
    gp, dp = max(16, common.next_pow2(g)), common.next_pow2(d)
    # bf16: 64 keys per step, 4 warps, 2 stages, the best of the H200 sweep at B=64 ctx
    # 2048 (0.136 ms, 3.95 TB/s; scripts/bench_kernels.py); fp8: default_settings.
    fit = default_settings(dp, bs, k_cache.dtype.itemsize)
    blocks_per_step, num_stages = blocks_per_step or fit[0], num_stages or fit[1]
    tile = blocks_per_step * bs
    max_steps = common.cdiv(block_tables.shape[1] * bs, tile)
    ns = default_k_splits(num_seqs, hkv, max_steps)
    # A bucket that fills the card with one split per row gains nothing from sharing
    # (its live rows are most of it); k_splits is then the fixed split's count.
    spread = spread and ns > 1
    ns = ns if spread or not k_splits else k_splits
    # Partial outputs sit in slots [split, row]. Spread: up to `slots` splits a live
    # row, S x ns programs' worth of work, and S x slots programs, so that the ones
    # left over write every unused slot empty and the combine needs no mask.
    slots = max(ns, min(k_splits or SPREAD_SPLITS, max_steps)) if spread else ns
    plan = spread_plan(seq_lens, num_seqs * ns, slots) if spread else None
    dot_dtype = jnp.dtype(default_dot_dtype(q.dtype, k_cache.dtype) if dot_dtype is None
                          else dot_dtype)
    # A query cast for the dots takes sm_scale * log2(e) along (see default_dot_dtype).
    q_scale = sm_scale * common.LOG2E if dot_dtype != q.dtype else None
    kernel = functools.partial(
        _decode_kernel, hq=hq, q_stride=q_stride, g=g, gp=gp, d=d, dp=dp, bs=bs, tile=tile,
        num_splits=ns, window=sliding_window, v_scale=v_scale, per_block=per_block,
        dot_dtype=dot_dtype, q_scale=q_scale, hkv=hkv, k_scale=k_scale,
        scale2=k_scale * (1.0 if q_scale else sm_scale * common.LOG2E))
    part_dtype = jnp.float32 if ns > 1 else q.dtype
    pool_spec = pl.BlockSpec((None, nb * bs, d), lambda s, h, k: (h, 0, 0))
    full = lambda x: pl.BlockSpec(x.shape, lambda s, h, k: (0,) * x.ndim)  # noqa: E731
    q2 = q.reshape(num_seqs * q_stride, d)
    pools = (k_cache.reshape(hkv, nb * bs, d), v_cache.reshape(hkv, nb * bs, d))
    # Arguments: block tables, seq_lens, [plan], [slot_mapping], q, pools; the kernel
    # gets None for the ones a launch does not take.
    small = [block_tables, seq_lens] + [x for x in (plan, slot_mapping) if x is not None]
    out_shape = [jax.ShapeDtypeStruct((slots, num_seqs * hq, d), part_dtype),
                 jax.ShapeDtypeStruct((slots, num_seqs * hq), jnp.float32)]
    out_specs = [pl.BlockSpec((slots, num_seqs * hq, d), lambda s, h, k: (0, 0, 0)),
                 pl.BlockSpec((slots, num_seqs * hq), lambda s, h, k: (0, 0))]
    if write:               # the pools again, aliased, written in place
        out_shape += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools]
        out_specs += [pool_spec, pool_spec]
    outs = common.pallas_call(
        functools.partial(_bind, kernel, plan is not None, write),
        grid=(num_seqs, hkv, slots),
        in_specs=[full(x) for x in small + [q2]] + [pool_spec, pool_spec],
        out_specs=out_specs, out_shape=out_shape,
        input_output_aliases={len(small) + 1: 2, len(small) + 2: 3} if write else {},
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        name="paged_attention_decode",
    )(*small, q2, *pools)
    o, lse = outs[:2]
    out = (o[0] if slots == 1 else combine_splits(o, lse)).reshape(num_seqs, hq, d)
    if not write:            # (the pools returned unchanged would be copied out)
        return out.astype(q.dtype), None, None
    return (out.astype(q.dtype), outs[2].reshape(k_cache.shape),
            outs[3].reshape(v_cache.shape))


def spread_plan(seq_lens, work: int, slots: int):
    """The ``spread`` assignment of S x slots programs: ``k`` = min(work // live, slots)
    splits per live row, the r-th live row (in row order) taking programs r*k .. r*k +
    k - 1; each program after those writes one slot that no split fills (splits k ..
    slots - 1 of a live row, every slot of a dead one) as empty.

    Returns plan i32[4, S x slots]: each program's row, split (its slot), kv length (0:
    write the slot empty) and k. The length is in the plan so that a program's KV
    loads wait on two loads (plan, block table), as with the fixed split (seq_lens,
    block table)."""
    num_seqs = seq_lens.shape[0]
    rows = jnp.arange(num_seqs, dtype=jnp.int32)
    live = seq_lens > 0
    nlive = live.sum(dtype=jnp.int32)
    k = jnp.clip(work // jnp.maximum(nlive, 1), 1, slots).astype(jnp.int32)
    p = jnp.arange(num_seqs * slots, dtype=jnp.int32)
    # Working programs: live row of rank p // k, split p % k.
    rank = jnp.cumsum(live, dtype=jnp.int32) - 1
    owner = live[None, :] & (rank[None, :] == (p // k)[:, None])          # [P, S]
    work_row = (owner * rows[None, :]).sum(axis=1, dtype=jnp.int32)
    # The others: the m-th unused slot, rows in order, each row's unused splits in order.
    unused = jnp.where(live, slots - k, slots)                            # [S]
    end = jnp.cumsum(unused, dtype=jnp.int32)
    m = p - nlive * k
    fill_row = jnp.minimum((end[None, :] <= m[:, None]).sum(axis=1, dtype=jnp.int32),
                           num_seqs - 1)
    fill_split = m - (end - unused)[fill_row] + jnp.where(live[fill_row], k, 0)
    working = p < nlive * k
    return jnp.stack([jnp.where(working, work_row, fill_row),
                      jnp.where(working, p % k, fill_split),
                      jnp.where(working, seq_lens[work_row], 0),
                      jnp.broadcast_to(k, p.shape)]).astype(jnp.int32)


def combine_splits(o, lse):
    """o [NS, R, D] (each split normalized), lse [NS, R] (log2, -inf if empty) -> [R, D].

    Written as NS elementwise terms, not as reductions over the split axis: XLA then
    emits one loop fusion (each output element redoes the NS-term max and sum, which
    costs nothing next to a launch) where the reduce-based form took three kernels
    per layer (exp, reduce, divide; ~4 us of a small-batch decode step's layer)."""
    ns = o.shape[0]
    o = o.astype(jnp.float32)
    mx = lse[0]
    for i in range(1, ns):
        mx = jnp.maximum(mx, lse[i])
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = [jnp.exp2(lse[i] - mx) for i in range(ns)]
    den, num = w[0], w[0][:, None] * o[0]
    for i in range(1, ns):
        den = den + w[i]
        num = num + w[i][:, None] * o[i]
    return num / jnp.where(den == 0.0, 1.0, den)[:, None]


def _bind(kernel, has_plan, write, bt_ref, lens_ref, *refs):
    """The launch's refs in _decode_kernel's order, None for those it does not take."""
    refs = list(refs)
    plan_ref = refs.pop(0) if has_plan else None
    slot_ref = refs.pop(0) if write else None
    q_ref, k_ref, v_ref, o_ref, lse_ref, *pools = refs
    kc_ref, vc_ref = pools if write else (None, None)
    return kernel(bt_ref, lens_ref, plan_ref, slot_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                  kc_ref, vc_ref)


def _decode_kernel(bt_ref, lens_ref, plan_ref, slot_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                   kc_ref, vc_ref, *, hq, q_stride, g, gp, d, dp, bs, tile, num_splits,
                   window, scale2, v_scale, per_block, dot_dtype, q_scale, hkv, k_scale):
    s, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head = h * g + jnp.minimum(jnp.arange(gp), g - 1)
    row_ok = jnp.arange(gp) < g
    if plan_ref is not None:     # spread: plan program p = split * S + s
        p = split * lens_ref.shape[0] + s
        s, split, kvlen, num_splits = (plan_ref[i, p] for i in range(4))
    else:
        kvlen = lens_ref[s]
    rows = s * hq + head
    q = common.load_rows(q_ref, s * q_stride + head, d, dp, row_ok)
    if q_scale is not None:
        q = (q.astype(jnp.float32) * q_scale).astype(dot_dtype)

    lo = 0 if window is None else jnp.maximum(kvlen - window, 0)
    first = lax.div(lo, tile) if window is not None else 0
    last = common.cdiv(kvlen, tile)
    per = common.cdiv(last - first, num_splits)
    start = jnp.minimum(first + split * per, last)
    end = jnp.minimum(start + per, last)
    # Steps fully inside [lo, kvlen) need no mask; only the last one is partial. With a
    # write the newest key's step is a masked one too: it takes that key from qkv.
    newest = kvlen - 1 if kc_ref is not None else kvlen
    full_end = start if window is not None else jnp.clip(lax.div(newest, tile), start, end)
    new_kv = None
    if kc_ref is not None:       # this step's key and value, as the pool stores them
        slot = slot_ref[s]
        new_kv = _new_kv(q_ref, s * q_stride + hq + h, hkv, d, dp, (k_scale, v_scale),
                         kc_ref.dtype)

    def masked_step(i, carry):
        def kv_mask(kpos):
            ok = kpos < kvlen
            return ok if window is None else ok & (kpos >= lo)
        kpos, kvalid, k, v = common.kv_tile(bt_ref, k_ref, v_ref, s, i * tile, tile=tile,
                                            block_size=bs, d=d, dp=dp, kv_mask_fn=kv_mask,
                                            dtype=q.dtype, per_block=per_block)
        if new_kv is not None:   # (slot < 0: nothing is written, the pool's row is read)
            is_new = ((kpos == kvlen - 1) & (slot >= 0))[:, None]
            k = jnp.where(is_new, new_kv[0].astype(k.dtype)[None, :], k)
            v = jnp.where(is_new, new_kv[1].astype(v.dtype)[None, :], v)
        mask = jnp.broadcast_to(kvalid[None, :], (gp, tile))
        return common.softmax_step(q, k, v, mask, carry, scale2)

    carry = common.unmasked_loop(bt_ref, k_ref, v_ref, s, start, full_end, q,
                                 common.init_carry(gp, dp), tile=tile, block_size=bs, d=d,
                                 dp=dp, scale2=scale2, per_block=per_block)
    m, l, acc = lax.fori_loop(full_end, end, masked_step, carry)

    l_safe = jnp.where(l == 0.0, 1.0, l)
    common.store_rows(o_ref, rows, acc * (v_scale / l_safe)[:, None], d, row_ok, lead=(split,))
    lse = jnp.where(l == 0.0, -jnp.inf, m + jnp.log(l_safe) * common.LOG2E)
    common.store_vec(lse_ref, rows, lse, row_ok, lead=(split,))
    if new_kv is not None:
        # The one program whose steps hold the newest key writes it (slot < 0: padding).
        step = lax.div(jnp.maximum(kvlen - 1, 0), tile)
        mine = (kvlen > 0) & (start <= step) & (step < end) & (slot >= 0)
        one = (jnp.arange(gp) == 0) & mine
        dst = jnp.full((gp,), jnp.maximum(slot, 0))
        for ref, x in zip((kc_ref, vc_ref), new_kv):
            common.store_rows(ref, dst, jnp.broadcast_to(x[None, :], (gp, dp)), d, one)


def _new_kv(q_ref, k_row, hkv, d, dp, scales, cache_dtype):
    """This step's key and value of one KV head, [Dp] each, from the qkv rows (k_row,
    k_row + Hkv), as the pool stores them (fp8: divided by the scale, then cast)."""
    out = []
    for row, scale in zip((k_row, k_row + hkv), scales):
        x = common.load_row(q_ref, row, d, dp)
        if common.is_fp8(cache_dtype):
            x = common.fp8_scaled(x, scale, cache_dtype)
        out.append(x.astype(cache_dtype))
    return out
