"""Random paged-attention inputs for the kernel tests, and helpers to run them.

Every pool slot that does not hold a live token (spare blocks, the null block 0, the
tail of a partial last block) is NaN, and block-table columns past a sequence's end
point at random other blocks, so anything the kernels read but should not use shows.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

FP8 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2      # --kv-cache-dtype fp8_e5m2: no scale (vLLM's)
# Interpret-mode kernels are large loops; XLA's CPU backend compiles them several times
# faster without its expensive LLVM passes, and they run just as correctly.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def run(fn, *args):
    """jit(fn)(*args), compiled with FAST_COMPILE."""
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


@dataclass
class Case:
    q: jax.Array            # [T, Hq, D]
    k_cache: jax.Array      # [Hkv, NB, BS, D]
    v_cache: jax.Array
    block_tables: jax.Array  # [S, B]
    seq_lens: jax.Array     # [S]
    query_start_loc: jax.Array  # [S + 1]

    @property
    def attn_args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc)


def make_case(seed, *, q_lens, kv_lens, hq, hkv, d, bs, pad_tokens=0, dtype=jnp.float32,
              kv_dtype=None, scale=1.0, spare_blocks=3, extra_cols=2) -> Case:
    """A ragged batch: sequence i has kv_lens[i] tokens of which the last q_lens[i] are
    this step's queries. KV values are stored divided by `scale` (fp8 style)."""
    rng = np.random.default_rng(seed)
    kv_dtype = kv_dtype or dtype
    nblk = [-(-int(n) // bs) for n in kv_lens]
    num_blocks = 1 + sum(nblk) + spare_blocks
    width = max(max(nblk), 1) + extra_cols
    ids = rng.permutation(np.arange(1, num_blocks))
    tables = rng.integers(0, num_blocks, (len(kv_lens), width)).astype(np.int32)
    kc = np.full((hkv, num_blocks, bs, d), np.nan, np.float32)
    vc = kc.copy()
    used = 0
    for i, n in enumerate(kv_lens):
        tables[i, :nblk[i]] = ids[used:used + nblk[i]]
        used += nblk[i]
        for t in range(n):
            b, o = tables[i, t // bs], t % bs
            kc[:, b, o] = rng.standard_normal((hkv, d)) / scale
            vc[:, b, o] = rng.standard_normal((hkv, d)) / scale
    num_tokens = int(sum(q_lens)) + pad_tokens
    q = rng.standard_normal((num_tokens, hq, d))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return Case(jnp.asarray(q, dtype), jnp.asarray(kc, kv_dtype), jnp.asarray(vc, kv_dtype),
                jnp.asarray(tables), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(qsl))


def assert_close(out, ref, rtol=1e-5):
    """|out - ref| <= rtol * (|ref| + max|ref|), no NaN anywhere."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert not np.isnan(out).any(), "NaN leaked into the output"
    err = np.abs(out - ref)
    tol = rtol * (np.abs(ref) + np.abs(ref).max())
    assert (err <= tol).all(), f"max err {err.max():.3g} (max |ref| {np.abs(ref).max():.3g})"


def same_bits(a, b) -> bool:
    """Exact equality, NaN == NaN (compares the raw bytes)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
