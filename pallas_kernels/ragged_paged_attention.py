"""Ragged paged attention: query chunks of many sequences packed flat, each attending
causally to its cached prefix plus itself through its block table.

Letter legend: T query tokens (flat, padded), S sequences (padded), Hq query heads,
Hkv KV heads, G = Hq // Hkv, D head dim, NB blocks in the pool, BS block size,
B blocks per block-table row.

Metadata (all int32): ``block_tables [S, B]``, ``seq_lens [S]`` = context length after
this step's tokens are written (0 for padding rows), ``query_start_loc [S + 1]`` =
cumulative query counts; tokens at or past ``query_start_loc[-1]`` are padding. The
query tokens of a sequence are its last ``q_len`` positions, so a query's position is
``seq_len - q_len + i``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common

_NEG_INF = float("-inf")


def token_positions(query_start_loc, seq_lens, num_tokens):
    """Per flat token: (sequence index i32[T], position i32[T], valid bool[T])."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = seq_lens.shape[0]
    seq = jnp.searchsorted(query_start_loc, t, side="right").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, num_seqs - 1)
    valid = t < query_start_loc[-1]
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    pos = seq_lens[seq] - q_len + (t - query_start_loc[seq])
    return seq, pos, valid


def ref_ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                               *, sm_scale, sliding_window=None, k_scale=1.0, v_scale=1.0):
    """q: [T, Hq, D]; k_cache, v_cache: [Hkv, NB, BS, D] -> out [T, Hq, D] (q's dtype).

    Plain jnp: a loop over block columns with an online softmax, so memory stays
    O(T * BS) whatever the context length. Padding tokens give zeros.
    """
    num_tokens, hq, d = q.shape
    hkv, _, bs, _ = k_cache.shape
    g = hq // hkv
    seq, pos, valid = token_positions(query_start_loc, seq_lens, num_tokens)
    qg = q.reshape(num_tokens, hkv, g, d).astype(jnp.float32) * sm_scale
    num_iters = (jnp.max(seq_lens) + bs - 1) // bs

    def body(j, carry):
        m, l, acc = carry
        blk = block_tables[seq, j]                                 # [T]
        kpos = j * bs + jnp.arange(bs)                             # [BS]
        mask = (kpos[None, :] <= pos[:, None]) & valid[:, None]    # [T, BS]
        if sliding_window is not None:
            mask &= kpos[None, :] > pos[:, None] - sliding_window
        kb = _load(k_cache, blk, mask, k_scale)                    # [Hkv, T, BS, D]
        vb = _load(v_cache, blk, mask, v_scale)
        s = jnp.einsum("thgd,htkd->thgk", qg, kb)
        s = jnp.where(mask[:, None, None, :], s, _NEG_INF)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)          # rows with no key yet
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("thgk,htkd->thgd", p, vb)
        return m_new, l, acc

    init = (jnp.full((num_tokens, hkv, g), _NEG_INF, jnp.float32),
            jnp.zeros((num_tokens, hkv, g), jnp.float32),
            jnp.zeros((num_tokens, hkv, g, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_iters, body, init)
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
    return out.reshape(num_tokens, hq, d).astype(q.dtype)


def _load(cache, blk, mask, scale):
    """Gather blocks [Hkv, T, BS, D] as float32; masked slots become 0 so that NaN or
    garbage in unused pool slots never reaches the output."""
    x = cache[:, blk].astype(jnp.float32)
    if cache.dtype.itemsize == 1:
        x = x * scale
    return jnp.where(mask[None, :, :, None], x, 0.0)


# --- Pallas kernel -----------------------------------------------------------------
# Grid (tiles, Hkv). A tile is up to `block_q` query tokens of ONE sequence; the rows of
# a program are (token, query head of this KV head) pairs, head-minor, so the G heads
# share each loaded KV block and M = block_q * Gp fills the dot. The tile schedule is
# computed in XLA from query_start_loc (at most cdiv(T, block_q) + S + 1 tiles, a
# static bound); spare tiles have no tokens and exit at once. Padding tokens (at or
# past query_start_loc[-1]) are covered by tiles of a pseudo-sequence with no keys, so
# they come out as zeros like the reference's.

_TILE_FIELDS = 5  # block-table row, first flat token, tokens, first position, kv length


def tile_schedule(query_start_loc, seq_lens, num_tokens, block_q):
    """i32[NT, 5] rows (bt_row, tok0, ntok, pos0, kv_len), heaviest tiles first."""
    num_seqs = seq_lens.shape[0]
    num_tiles = -(-num_tokens // block_q) + num_seqs + 1
    qsl = query_start_loc.astype(jnp.int32)
    q_lens = jnp.append(qsl[1:] - qsl[:-1], num_tokens - qsl[-1])   # [S + 1]
    kv_lens = jnp.append(seq_lens.astype(jnp.int32), 0)
    n = (q_lens + block_q - 1) // block_q
    cum = jnp.cumsum(n)
    i = num_tiles - 1 - jnp.arange(num_tiles, dtype=jnp.int32)    # last tiles first
    # One broadcast compare ([NT, S + 1], small): searchsorted's default is a while
    # loop, and XLA's GPU while loop reads its condition back to the host every trip.
    # On the H200 the schedule took 87-197 us per call that way against 39-68 us as one
    # compare, more than the kernel itself at short prompts (8 x 32 tokens: schedule
    # and kernel 129 us with the loop, 60 us with the compare).
    seq = jnp.searchsorted(cum, i, side="right", method="compare_all").astype(jnp.int32)
    sc = jnp.minimum(seq, num_seqs)
    j = i - (cum[sc] - n[sc])
    ntok = jnp.where(seq <= num_seqs, jnp.clip(q_lens[sc] - j * block_q, 0, block_q), 0)
    pos0 = kv_lens[sc] - q_lens[sc] + j * block_q
    return jnp.stack([jnp.minimum(sc, num_seqs - 1), qsl[sc] + j * block_q, ntok, pos0,
                      kv_lens[sc]], axis=1)


def default_settings(gp: int, dp: int, bs: int, kv_itemsize: int) -> tuple[int, int, int]:
    """(block_q, blocks_per_step, num_stages) for padded heads per KV head gp, padded
    head dim dp, block size bs: the tuned 256 rows x 64 keys x 3 stages where they fit,
    fewer rows where the f32 accumulator [rows, Dp] would outgrow the registers, and a
    KV pipeline within the shared-memory budget."""
    block_q = max(1, min(256, common.ACC_BYTES // (4 * dp)) // gp)
    blocks_per_step, num_stages = common.fit_kv_pipeline(bs, max(1, 64 // bs), dp,
                                                         kv_itemsize, 3)
    return block_q, blocks_per_step, num_stages


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "k_scale", "v_scale", "block_q", "blocks_per_step",
    "num_warps", "num_stages", "interpret"))
def ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           *, sm_scale, sliding_window=None, k_scale=1.0, v_scale=1.0,
                           block_q=None, blocks_per_step=None, num_warps=8, num_stages=None,
                           interpret=False):
    """Same contract as ``ref_ragged_paged_attention``; the rest are kernel settings
    (block_q query tokens per program, blocks_per_step pool blocks per inner step).
    Unset ones follow the dtype and head dim (common.fit_kv_pipeline)."""
    num_tokens, hq, d = q.shape
    hkv, nb, bs, _ = k_cache.shape
    g = hq // hkv
    gp, dp = common.next_pow2(g), common.next_pow2(d)
    # 256 rows per program over 2 warpgroups, 64 keys per step, 8 warps, 3 stages: on
    # the H200 at 8 x 2048 causal, 0.773 ms against 0.854 ms for the best 128-row
    # setting and 1.038 ms for 128 rows on 4 warps (scripts/bench_kernels.py sweep);
    # 4 stages gave 0.760 ms, 3 are kept for their smaller shared-memory footprint.
    fit = default_settings(gp, dp, bs, k_cache.dtype.itemsize)
    block_q, blocks_per_step = block_q or fit[0], blocks_per_step or fit[1]
    num_stages = num_stages or fit[2]
    tiles = tile_schedule(query_start_loc, seq_lens, num_tokens, block_q)
    kernel = functools.partial(
        _ragged_kernel, hq=hq, g=g, gp=gp, d=d, dp=dp, bs=bs, block_q=block_q,
        tile=blocks_per_step * bs, window=sliding_window,
        scale2=sm_scale * k_scale * common.LOG2E, v_scale=v_scale)
    pool_spec = pl.BlockSpec((None, nb * bs, d), lambda t, h: (h, 0, 0))
    full = lambda x: pl.BlockSpec(x.shape, lambda t, h: (0,) * x.ndim)  # noqa: E731
    q2 = q.reshape(num_tokens * hq, d)
    out = common.pallas_call(
        kernel,
        grid=(tiles.shape[0], hkv),
        in_specs=[full(tiles), full(block_tables), full(q2), pool_spec, pool_spec],
        out_specs=full(q2),
        out_shape=jax.ShapeDtypeStruct(q2.shape, q.dtype),
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        name="ragged_paged_attention",
    )(tiles, block_tables, q2, k_cache.reshape(hkv, nb * bs, d),
      v_cache.reshape(hkv, nb * bs, d))
    return out.reshape(num_tokens, hq, d)


def _ragged_kernel(tiles_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *, hq, g, gp, d, dp, bs,
                   block_q, tile, window, scale2, v_scale):
    t, h = pl.program_id(0), pl.program_id(1)
    seq, tok0, ntok, pos0, kvlen = (tiles_ref[t, f] for f in range(_TILE_FIELDS))
    r = jnp.arange(block_q * gp)
    tok, head = lax.div(r, gp), lax.rem(r, gp)
    row_ok = (tok < ntok) & (head < g)
    rows = jnp.where(row_ok, (tok0 + tok) * hq + h * g + head, 0)
    qpos = pos0 + tok

    @pl.when(ntok > 0)
    def _():
        q = common.load_rows(q_ref, rows, d, dp, row_ok)
        hi = jnp.clip(pos0 + ntok, 0, kvlen)             # keys [lo, hi)
        lo = 0 if window is None else jnp.maximum(pos0 - window + 1, 0)
        start = lax.div(lo, tile) if window is not None else 0
        end = common.cdiv(hi, tile)
        # Steps wholly at or before the tile's first query need no mask.
        full_end = start if window is not None else jnp.clip(lax.div(pos0 + 1, tile),
                                                             start, end)

        def masked_step(i, carry):
            kpos, kvalid, k, v = common.kv_tile(
                bt_ref, k_ref, v_ref, seq, i * tile, tile=tile, block_size=bs, d=d, dp=dp,
                kv_mask_fn=lambda kpos: (kpos < hi) & (kpos >= lo), dtype=q.dtype,
                per_block=True)
            mask = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
            if window is not None:
                mask &= kpos[None, :] > qpos[:, None] - window
            return common.softmax_step(q, k, v, mask, carry, scale2)

        carry = common.unmasked_loop(bt_ref, k_ref, v_ref, seq, start, full_end, q,
                                     common.init_carry(block_q * gp, dp), tile=tile,
                                     block_size=bs, d=d, dp=dp, scale2=scale2,
                                     per_block=True)
        _, l, acc = lax.fori_loop(full_end, end, masked_step, carry)
        out = acc * (v_scale / jnp.where(l == 0.0, 1.0, l))[:, None]
        common.store_rows(o_ref, rows, out, d, row_ok)
