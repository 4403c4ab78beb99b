"""The pooling model runner: token lists in, pooled float32 vectors out.

Inputs are padded [B, T] buckets, not one packed ragged row. Grouped by length, each
step's rows are near-equal in length (T buckets every 4 tokens up to 128: texts of
9-65 tokens pad 4% of their tokens, against 10% with buckets every 8), so padding
costs little, and attention stays within a row (cuDNN's fused kernel on a GPU for
the decoders, see decoder.py); a packed step with segment ids would need an [N, N]
mask over all its tokens (or a segment-aware kernel) to keep texts apart. A step
fills the token budget (max_num_batched_tokens, at most max_num_seqs rows); a (B, T)
shape compiles once on first use. Rows join their bucket's next step as they arrive;
a bucket's step launches once full, and the leftovers go at the end.

Each step is one host-to-device array (ids, lengths, dimensions and the normalize
flag packed as int32 [B, T + 3]) and one device-to-host array (float32 [B, E]):
pooling, the Matryoshka cut and normalization run on the device. Three steps are in
flight: the host packs step i + 2 while the device runs step i with i + 1 queued, so
a host pause shorter than a step (a new chunk's tokens copied in, the tokenizer
thread holding the GIL) leaves the device busy.

Letter legend: B rows, T tokens, E hidden, N texts.
"""
from __future__ import annotations

import bisect
import collections
import functools
import itertools
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.pooling.decoder import decoder_hidden, pick_attention
from jaxllm.pooling.loading import LoadedPoolingModel


def seq_buckets(max_len: int) -> list[int]:
    """Row lengths a step is padded to: every 4 up to 128, every 32 up to 512, then
    powers of two, the last one max_len."""
    out = [t for t in range(4, 129, 4)] + [t for t in range(160, 513, 32)]
    t = 1024
    while t < max_len:
        out.append(t)
        t *= 2
    return sorted({min(t, max_len) for t in out} | {max_len})


def _pool_step(graphdef, state, packed, *, pooling: str, is_encoder: bool, attention: str):
    """packed: i32 [B, T + 3] = ids | length | dimensions | normalize -> f32 [B, E]."""
    model = nnx.merge(graphdef, state)
    ids, lengths = packed[:, :-3], packed[:, -3]
    dims, normalize = packed[:, -2], packed[:, -1] > 0
    hidden = (model(ids, lengths) if is_encoder
              else decoder_hidden(model, ids, lengths, attention))
    hidden = hidden.astype(jnp.float32)
    b, t, e = hidden.shape
    if pooling == "CLS":
        pooled = hidden[:, 0]
    elif pooling == "LAST":
        pooled = hidden[jnp.arange(b), jnp.maximum(lengths - 1, 0)]
    else:   # MEAN over the row's real tokens
        valid = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.float32)
        pooled = jnp.einsum("bte,bt->be", hidden, valid) / jnp.maximum(
            valid.sum(axis=1, keepdims=True), 1.0)
    # Matryoshka: the first d dimensions, normalized after the cut (as vLLM).
    pooled = jnp.where(jnp.arange(e)[None, :] < dims[:, None], pooled, 0.0)
    norm = jnp.sqrt(jnp.sum(pooled * pooled, axis=-1, keepdims=True))
    return jnp.where(normalize[:, None], pooled / jnp.maximum(norm, 1e-12), pooled)


class PoolingRunner:
    def __init__(self, loaded: LoadedPoolingModel, pooling_type: str, max_model_len: int,
                 max_num_batched_tokens: int, max_num_seqs: int):
        self.graphdef, self.state = loaded.graphdef, loaded.state
        self.pooling_type, self.is_encoder = pooling_type, loaded.is_encoder
        self.hidden_size = loaded.arch.hidden_size
        self.max_model_len = max_model_len
        self.budget, self.max_rows = max_num_batched_tokens, max_num_seqs
        self.buckets = seq_buckets(max_model_len)
        # The encoder's attention is models/bert.py's own (jnp, bidirectional).
        self.attention = "xla" if loaded.is_encoder else pick_attention(loaded.arch,
                                                                         loaded.dtype)
        self._steps: dict[str, Callable] = {}

    def step_fn(self, attention: str | None = None) -> Callable:
        """The jitted step, fn(state, packed) -> float32 [B, E], with this runner's
        attention or `attention` ("cudnn" or "xla"; benchmarks compare the two)."""
        attention = attention or self.attention
        if attention not in self._steps:
            self._steps[attention] = jax.jit(functools.partial(
                _pool_step, self.graphdef, pooling=self.pooling_type,
                is_encoder=self.is_encoder, attention=attention))
        return self._steps[attention]

    def rows_for(self, t: int) -> int:
        """Rows of a full step padded to length t."""
        return max(1, min(self.max_rows, self.budget // t))

    def bucket(self, length: int) -> int:
        """The T a row of `length` tokens is padded to."""
        return self.buckets[bisect.bisect_left(self.buckets, length)]

    def plan(self, lengths: np.ndarray) -> list[tuple[np.ndarray, int, int]]:
        """Steps as (row indices into `lengths`, T, B) for all rows at once."""
        planner = _Planner(self)
        return planner.add(np.arange(len(lengths)), lengths) + planner.flush()

    def run(self, token_lists: list, dims: np.ndarray, normalize: np.ndarray,
            on_step: Callable[[int], None] | None = None) -> np.ndarray:
        """token_lists: N lists of ids (each 1..max_model_len long); dims: i32 [N]
        (E = whole); normalize: bool [N]. Returns float32 [N, E] in input order.
        on_step(rows done) is called as each step's vectors arrive."""
        return self.run_stream([token_lists], dims, normalize, on_step)

    def lower_step(self, packed: np.ndarray, attention: str | None = None):
        """The step lowered for a packed batch of this shape (benchmarks compile every
        shape ahead of a timed run)."""
        return self.step_fn(attention).lower(self.state, packed)

    def run_stream(self, chunks: Iterable[list], dims: np.ndarray, normalize: np.ndarray,
                   on_step: Callable[[int], None] | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
        """`run` over token lists that arrive in chunks (N rows in all = len(dims)):
        full steps launch while later chunks are still being tokenized. `out`
        (float32 [N, E]) is filled if given, so callers can hand out views of its rows
        before the run ends."""
        if out is None:
            out = np.empty((len(dims), self.hidden_size), np.float32)
        store = _TokenStore(len(dims))
        planner = _Planner(self)
        in_flight: collections.deque = collections.deque()
        step = self.step_fn()

        def finish(keep: int) -> None:
            while len(in_flight) > keep:
                rows, result = in_flight.popleft()
                out[rows] = np.asarray(result)[:len(rows)]
                if on_step is not None:
                    on_step(len(rows))

        def launch(steps) -> None:
            for rows, t, b in steps:
                packed = np.zeros((b, t + 3), np.int32)
                packed[:len(rows), :t] = store.padded(rows, t)
                packed[:len(rows), -3] = store.lengths[rows]
                packed[:len(rows), -2] = dims[rows]
                packed[:len(rows), -1] = normalize[rows]
                in_flight.append((rows, step(self.state, packed)))
                finish(2)

        for chunk in chunks:
            rows = store.add(chunk)
            launch(planner.add(rows, store.lengths[rows]))
        launch(planner.flush())
        finish(0)
        return out


class _TokenStore:
    """Every row's ids in one flat int32 buffer (row r at offsets[r]), so a step's
    [B, T] block is one numpy gather instead of a Python loop over its rows."""

    def __init__(self, rows: int):
        self.flat = np.zeros(1 << 16, np.int32)
        self.size = self.count = 0
        self.offsets = np.zeros(rows, np.int64)
        self.lengths = np.zeros(rows, np.int32)

    def add(self, token_lists: list) -> np.ndarray:
        n = len(token_lists)
        lengths = np.fromiter(map(len, token_lists), np.int32, n)
        total = int(lengths.sum())
        while self.size + total > len(self.flat):
            self.flat = np.concatenate([self.flat, np.zeros_like(self.flat)])
        self.flat[self.size:self.size + total] = np.fromiter(
            itertools.chain.from_iterable(token_lists), np.int32, total)
        rows = np.arange(self.count, self.count + n)
        self.lengths[rows] = lengths
        self.offsets[rows] = self.size + np.cumsum(lengths) - lengths
        self.size += total
        self.count += n
        return rows

    def padded(self, rows: np.ndarray, t: int) -> np.ndarray:
        cols = np.arange(t)
        index = self.offsets[rows][:, None] + cols[None, :]
        valid = cols[None, :] < self.lengths[rows][:, None]
        return np.where(valid, self.flat[np.where(valid, index, 0)], 0)


class _Planner:
    """Rows into steps. Each length bucket launches a full step once it has one;
    what is left at the end goes longest first at full-step shapes (compiled
    already) and one partial step, so a run adds at most one new shape."""

    def __init__(self, runner: PoolingRunner):
        self.runner = runner
        self.buckets = np.asarray(runner.buckets)
        self.pending: dict[int, np.ndarray] = {}

    def add(self, rows: np.ndarray, lengths: np.ndarray) -> list:
        steps = []
        which = np.searchsorted(self.buckets, lengths, side="left")
        for k in np.unique(which).tolist():
            t = int(self.buckets[k])
            queue = np.concatenate([self.pending.get(t, rows[:0]), rows[which == k]])
            cap = self.runner.rows_for(t)
            full = len(queue) // cap * cap
            steps += [(queue[s:s + cap], t, cap) for s in range(0, full, cap)]
            self.pending[t] = queue[full:]
        return steps

    def flush(self) -> list:
        """The leftovers, longest bucket first; a step's T is its first row's bucket,
        so every row in it fits."""
        queues = [(t, q) for t, q in sorted(self.pending.items(), reverse=True) if len(q)]
        self.pending.clear()
        if not queues:
            return []
        rows = np.concatenate([q for _, q in queues])
        ts = np.concatenate([np.full(len(q), t) for t, q in queues])
        steps, i = [], 0
        while i < len(rows):
            t = int(ts[i])
            cap = self.runner.rows_for(t)
            take = rows[i:i + cap]
            steps.append((take, t, cap if len(take) == cap else _row_bucket(len(take), cap)))
            i += cap
        return steps


def _row_bucket(n: int, cap: int) -> int:
    """A partial step's rows: the next power of two (at least 8), at most cap."""
    b = 8
    while b < n:
        b *= 2
    return min(b, cap)
