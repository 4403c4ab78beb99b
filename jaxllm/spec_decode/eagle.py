"""EAGLE proposer (vLLM's EagleProposer, greedy drafts): an EAGLE-1 or EAGLE-3 head
(models/eagle.py) with its own one-layer KV pool of the target's block count,
indexed by the target's block ids.

What it needs after EVERY target step (prefill chunks and plain steps included, not
only steps of requests that decode next): ingest(target_hidden, scheduled,
step_requests, sampled), called by the executor as it reads each step back (in step
order; an async step after the next one was launched). `scheduled`: the runner's
rows (a verify step's k + 1 one-token rows), `target_hidden` [T, C] one row per input
token of the step in its order (T: the step's padded token count): EAGLE-1 the
target's final hidden state (after its norm; C = E), EAGLE-3
`LlamaForCausalLM(..., aux_layers=cfg.aux_layer_ids)`'s third output (C = 3G); the
target's runner returns it when built with `hidden_layers` (proposers.py).
`sampled`: the step's tokens, which the requests do not hold yet at read-back.

A target row at position p is ingested with token p + 1 when that token is known
(the verified ones: a verify step's rejected rows are skipped), writing the head's
KV at p from the target's own state, so the head needs no per-request bookkeeping:
every position it reads was written from the target's latest rows. The last
ingested row of a request that decodes next gives d0; propose() runs k - 1 head
steps on its own features for d1.. (the positions after, in the lookahead slots).
An ingest step is padded to its target step's token count (and propose's head
steps to a sequence bucket), so warm_up() compiles every program the engine runs.

Not recomputed (each only lowers acceptance, never changes the output: the target
verifies every draft): a prefix-cache hit skips the target's rows of the cached
blocks, so the head reads the KV the computing request's ingest wrote there, which
is right except at a block's last position, which holds that request's next token
(a request that shares the block but not the token after it reads one stale entry
per such block; vLLM recomputes the last cached block for EAGLE, which would need
the target's states there). A swapped-out request's head KV is not copied to the
host, so after its swap-in the head reads whatever its new blocks held at those
positions (for the rest of the request: the target does not run them again).
Recomputing either would take the target's states of rows the target did not run.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.engine.scheduler import ScheduledRequest
from jaxllm.layers.attention import AttentionSpec
from jaxllm.parallel import mesh as mesh_lib
from jaxllm.runner import input_batch, kv_cache
from jaxllm.runner.buckets import BucketPlan
from jaxllm.runner.step_fn import dummy_arrays
from jaxllm.runner.step_inputs import StepInputs


def _pad_rows(x, m: int):
    """x [S, ...] -> [M, ...] (zeros after): head steps take one input shape."""
    return jnp.zeros((m,) + x.shape[1:], x.dtype).at[:x.shape[0]].set(x)


def _ingest(graphdef, treedef, spec, m, leaves, kv, target_hidden, src_rows, inputs):
    """Head step over target rows: token ids of the next positions, features
    target_hidden[src_rows]. Returns (greedy d0 [M], its output feature [M, E], kv),
    a row per chunk (its last token), padded to M."""
    ids, pos, md, last = inputs.unpack()
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    h = model.combine_hidden_states(target_hidden[src_rows])
    final, out, kv = model(ids, h, pos, kv, md, spec)
    tokens = jnp.argmax(model.compute_logits(final[last]), -1).astype(jnp.int32)
    return _pad_rows(tokens, m), _pad_rows(out[last], m), kv


def _decode(graphdef, treedef, spec, m, leaves, kv, tokens, hidden, sel, inputs):
    """One head step on its own previous samples: row i feeds tokens[sel[i]] with
    feature hidden[sel[i]] (tokens [M], hidden [M, E]); outputs as _ingest's."""
    _, pos, md, _ = inputs.unpack()
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    final, out, kv = model(tokens[sel], hidden[sel], pos, kv, md, spec)
    d = jnp.argmax(model.compute_logits(final), -1).astype(jnp.int32)
    return _pad_rows(d, m), _pad_rows(out, m), kv


class _TargetShape:
    """prepare_inputs' plan for an ingest step: the target step's T tokens (its rows
    are a subset of the target's), decode-only when T is a sequence bucket and every
    row has one token; so the ingest compiles once per target step shape."""

    def __init__(self, plan: BucketPlan, num_tokens: int):
        self.plan, self.t = plan, num_tokens

    def shape_for(self, num_tokens, num_seqs, decode_only, ready=None):
        if decode_only and self.t in self.plan.seq_buckets:
            return self.t, self.t, True
        return self.t, self.plan.max_seqs, False


class EagleProposer:
    def __init__(self, cfg, graphdef, state, spec_config, mesh, block_size: int,
                 max_model_len: int, max_num_batched_tokens: int, max_rows: int,
                 shared=()):
        """`max_rows`: the target step's most rows (input_batch.max_rows): the head
        pads to the target's step shapes. `shared`: the target's arrays the head uses
        as they are (embedding, lm_head), not counted in weight_bytes."""
        self.cfg, self.spec_config, self.mesh = cfg, spec_config, mesh
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.plan = BucketPlan.build(max_num_batched_tokens, max_rows)
        self._replicated = mesh_lib.replicated(mesh)
        self.graphdef, self.state = graphdef, state
        self._leaves, treedef = jax.tree.flatten(state)
        shared = {id(x) for x in shared}
        self._own = [x for x in self._leaves if id(x) not in shared]
        self.dtype = state["embed_tokens"].get_value().dtype    # not d2t's int32
        # The draft's rows read keys other rows of their step write: KV written apart.
        spec = AttentionSpec(sm_scale=cfg.arch.head_dim ** -0.5, mesh=mesh,
                             decode_kv_write=False)
        args = (graphdef, treedef, spec, self.plan.max_seqs)
        # Fixed output shardings: the next head step (and the warm-up's padding inputs)
        # pass arrays of the same shardings, so each call finds the warm-up's program.
        outs = (self._replicated, self._replicated, mesh_lib.kv_cache_sharding(mesh))
        self._ingest = jax.jit(functools.partial(_ingest, *args), donate_argnums=(1,),
                               out_shardings=outs)
        self._decode = jax.jit(functools.partial(_decode, *args), donate_argnums=(1,),
                               out_shardings=outs)
        self.kv_caches = None
        # The last ingest: (d0 [M], features [M, E], request id -> (its row, the
        # position after its last ingested one)).
        self._last = None

    @property
    def num_lookahead_tokens(self) -> int:
        return self.spec_config.num_speculative_tokens

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """EAGLE-3: the target layers whose entering residual streams target_hidden
        holds (in this order); () for EAGLE-1 (the final hidden state)."""
        return self.cfg.aux_layer_ids

    @property
    def hidden_size(self) -> int:
        """C, target_hidden's width."""
        return self.cfg.fc_in if self.cfg.method == "eagle3" else self.cfg.arch.hidden_size

    @classmethod
    def from_config(cls, engine_config, spec_config, target, target_num_blocks, mesh,
                    max_model_len: int, max_num_batched_tokens: int) -> "EagleProposer":
        """`target`: the target's LoadedModel (its embedding and head are shared).
        target_num_blocks None: no pool yet (initialize_kv_cache, after sizing)."""
        from jaxllm.models.eagle import load_eagle_head
        from jaxllm.runner.input_batch import max_rows
        dtype = target.state["embed_tokens"].get_value().dtype
        cfg, graphdef, state = load_eagle_head(spec_config.model, spec_config.method, target,
                                               dtype, mesh_lib.param_shardings(mesh))
        proposer = cls(cfg, graphdef, state, spec_config, mesh, engine_config.cache.block_size,
                       max_model_len, max_num_batched_tokens, max_rows(engine_config),
                       jax.tree.leaves(target.state))
        if target_num_blocks is not None:
            proposer.initialize_kv_cache(target_num_blocks)
        return proposer

    # ------------------------------------------------------------ sizing
    def kv_bytes_per_block(self) -> int:
        """Device bytes one block of the head's pool takes (per device)."""
        from jaxllm.parallel.mesh import pool_kv_heads
        arch, n = self.cfg.arch, self.mesh.size
        return kv_cache.bytes_per_block(arch, self.block_size, self.dtype) * pool_kv_heads(
            arch.num_kv_heads, n) // (arch.num_kv_heads * n)

    def weight_bytes(self) -> int:
        """The head's own weights (per device; not the target's arrays it shares)."""
        return kv_cache.device_bytes(self._own)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = kv_cache.allocate(
            self.cfg.arch, num_blocks, self.block_size, self.dtype,
            mesh_lib.kv_cache_sharding(self.mesh, self.cfg.arch.num_kv_heads),
            tp=self.mesh.size)

    def finish(self, request_ids) -> None:
        pass        # no per-request state (see the module docstring)

    def warm_up(self) -> float:
        """Compile the ingest step for every target step shape and the head's decode
        step for every sequence bucket, by running each on padding inputs (no KV slot
        written); the seconds it took."""
        t0 = time.perf_counter()
        m, rep = self.plan.max_seqs, self._replicated
        tokens = jax.device_put(np.zeros(m, np.int32), rep)
        feats = jax.device_put(np.zeros((m, self.cfg.arch.hidden_size), self.dtype), rep)
        for t, s, decode_only in self.plan.all_shapes():
            hidden = jax.device_put(np.zeros((t, self.hidden_size), self.dtype), rep)
            arrays = dummy_arrays(t, s, self.max_blocks_per_seq)
            out = self._ingest(self._leaves, self.kv_caches, hidden,
                               jax.device_put(np.zeros(t, np.int32), rep),
                               StepInputs.pack(arrays, decode_only, rep))
            self.kv_caches = out[2]
        for s in self.plan.seq_buckets:
            out = self._decode(self._leaves, self.kv_caches, tokens, feats,
                               jax.device_put(np.zeros(s, np.int32), rep),
                               StepInputs.pack(dummy_arrays(s, s, self.max_blocks_per_seq),
                                               True, rep))
            self.kv_caches = out[2]
        jax.block_until_ready(self.kv_caches)
        return time.perf_counter() - t0

    # ------------------------------------------------------------ proposing
    def ingest(self, target_hidden, scheduled, step_requests: dict,
               sampled: dict | None = None) -> None:
        """Write the head's KV for a target step's rows (`scheduled`: the runner's rows,
        `step_requests` id -> Request, `target_hidden` [T, C]) and keep its d0 for the
        requests it brought to their newest token. `sampled`: id -> the tokens the step
        sampled, when the requests do not hold them yet (the executor ingests a step
        as it reads it back, before the scheduler appends them)."""
        rows, chunks = self._ingest_rows(scheduled, step_requests, sampled or {})
        self._last = None
        if not chunks:
            return
        t = target_hidden.shape[0]
        arrays, decode_only, _ = input_batch.prepare_inputs(
            chunks, _TargetShape(self.plan, t), self.block_size, self.max_blocks_per_seq, {})
        src = np.zeros(t, np.int32)
        src[:len(rows)] = rows
        tokens, hidden, self.kv_caches = self._ingest(
            self._leaves, self.kv_caches, target_hidden, jax.device_put(src, self._replicated),
            StepInputs.pack(arrays, decode_only, self._replicated))
        index = {c.request_id: (i, c.num_computed_tokens + len(c.token_ids))
                 for i, c in enumerate(chunks)}      # a request's last chunk
        self._last = tokens, hidden, index

    def propose(self, requests, max_drafts, block_tables, target_hidden=None, scheduled=None,
                step_requests=None) -> list[list[int]]:
        """Up to max_drafts[i] greedy drafts for requests[i], from the last ingested
        step (given `target_hidden`, `scheduled`, `step_requests`: that step, ingested
        first). A request the last step did not bring to its newest token gets none."""
        if target_hidden is not None:
            self.ingest(target_hidden, scheduled, step_requests)
        out = [[] for _ in requests]
        if self._last is None:
            return out
        tokens, hidden, index = self._last
        want = []
        for i, (r, k, table) in enumerate(zip(requests, max_drafts, block_tables)):
            row, end = index.get(r.request_id, (None, None))
            k = min(k, self._room(r, table))
            if k > 0 and end == r.num_tokens - 1:
                want.append((i, row, k))
        if not want:
            return out
        steps = [tokens]          # [M] each: d0 at the requests' ingest rows, then row n
        sel = np.asarray([w[1] for w in want], np.int32)
        for j in range(1, max(w[2] for w in want)):
            arrays, s = self._decode_arrays(requests, want, block_tables, j)
            pad = np.zeros(s, np.int32)
            pad[:len(sel)] = sel
            tokens, hidden, self.kv_caches = self._decode(
                self._leaves, self.kv_caches, tokens, hidden, jax.device_put(pad, self._replicated),
                StepInputs.pack(arrays, True, self._replicated))
            sel = np.arange(len(want), dtype=np.int32)
            steps.append(tokens)
        # The head's KV now holds drafts past the newest token: the next propose needs
        # the next target step's ingest first.
        self._last = None
        got = [np.asarray(t) for t in jax.device_get(steps)]
        for n, (i, row, k) in enumerate(want):
            out[i] = [int(got[0][row])] + [int(got[j][n]) for j in range(1, k)]
        return out

    def _room(self, req, table) -> int:
        n = req.num_tokens
        return min(self.max_model_len - n + 1,
                   min(len(table), self.max_blocks_per_seq) * self.block_size - n + 1)

    def _ingest_rows(self, scheduled, step_requests, sampled: dict):
        """Rows of the target step to ingest (their index in target_hidden) and the
        head's chunks: of each row, the positions whose successor is known. A verify
        step's rows after its first rejected draft have none (their inputs were
        wrong): the request holds (or `sampled` brings) its tokens only up to the
        target's token that replaced the rejected draft."""
        starts = {}          # request id -> position of its first sampled token
        for r in scheduled:
            if r.do_sample and r.request_id in sampled and r.request_id not in starts:
                starts[r.request_id] = r.num_computed_tokens + len(r.token_ids)
        rows, chunks, off = [], [], 0
        for r in scheduled:
            req, m, c = step_requests[r.request_id], len(r.token_ids), r.num_computed_tokens
            nxt = _successors(req.all_token_ids, starts.get(r.request_id),
                              sampled.get(r.request_id, ()), c + 1, m)
            if nxt:                    # p = c + j needs token p + 1
                rows.extend(range(off, off + len(nxt)))
                chunks.append(ScheduledRequest(r.request_id, nxt, c,
                                               r.block_table[:self.max_blocks_per_seq],
                                               True, 0))
            off += m
        return rows, chunks

    def _decode_arrays(self, requests, want, block_tables, j: int):
        """Head step j for the wanted requests: feeds draft j - 1 at position n - 2 + j
        (n: the request's tokens); rows past a request's k write no KV."""
        chunks = []
        for i, _, k in want:
            r = requests[i]
            pos = r.num_tokens - 2 + min(j, k - 1)
            chunks.append(ScheduledRequest(r.request_id, [0], pos,
                                           block_tables[i][:self.max_blocks_per_seq], True, 0))
        arrays, _, s = input_batch.prepare_inputs(chunks, self.plan, self.block_size,
                                                  self.max_blocks_per_seq, {})
        for n, (_, _, k) in enumerate(want):
            if j > k - 1:
                arrays["slot_mapping"][n] = -1
        return arrays, s


def _successors(tokens: list[int], start: int | None, sampled, first: int,
                count: int) -> list[int]:
    """The tokens at positions first..first+count-1, as far as known: `tokens` below
    `start` (all of them when start is None), then `sampled` from `start` on."""
    if start is None:
        return tokens[first:first + count]
    if len(tokens) < start:      # not the request the step ran (never expected)
        return []
    end = first + count
    out = tokens[first:min(end, start)]
    if end > start:
        out += list(sampled[max(first - start, 0):end - start])
    return out
