"""EAGLE proposer (vLLM's EagleProposer, greedy drafts): an EAGLE-1 or EAGLE-3 head
(models/eagle.py) with its own one-layer KV pool of the target's block count,
indexed by the target's block ids.

What it needs after EVERY target step (prefill chunks and plain steps included, not
only steps of requests that decode next): the step's `scheduled` list, the requests
by id, and `target_hidden` [T, C], one row per input token of the step in its order
(T: the step's padded token count or more): EAGLE-1 the target's final hidden state
(after its norm; C = E), EAGLE-3 `LlamaForCausalLM(..., aux_layers=cfg.aux_layer_ids)`'s
third output (C = 3G).

A target row at position p is ingested with token p + 1 when that token is known
(the verified ones: a verify step's rejected rows are skipped), writing the head's
KV at p from the target's own state, so the head needs no per-request bookkeeping:
every position it reads was written from the target's latest rows. The last
ingested row of a request that decodes next gives d0; k - 1 head steps on its own
features give d1.. (the positions after, in the lookahead slots).

Not covered: a prefix-cache hit skips the target's rows of the cached blocks, so
the head's KV there is whatever the computing request wrote (vLLM recomputes the
last cached block for EAGLE); swapped-in requests likewise. Both lower acceptance
only.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.engine.scheduler import ScheduledRequest
from jaxllm.layers.attention import AttentionSpec
from jaxllm.parallel import mesh as mesh_lib
from jaxllm.runner import input_batch, kv_cache
from jaxllm.runner.buckets import BucketPlan
from jaxllm.runner.step_inputs import StepInputs


def _ingest(graphdef, treedef, spec, leaves, kv, target_hidden, src_rows, inputs):
    ids, pos, md, last = inputs.unpack()
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    h = model.combine_hidden_states(target_hidden[src_rows])
    final, out, kv = model(ids, h, pos, kv, md, spec)
    return jnp.argmax(model.compute_logits(final[last]), -1).astype(jnp.int32), out[last], kv


def _decode(graphdef, treedef, spec, leaves, kv, tokens, hidden, sel, inputs):
    _, pos, md, _ = inputs.unpack()
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    final, out, kv = model(tokens[sel], hidden[sel], pos, kv, md, spec)
    return jnp.argmax(model.compute_logits(final), -1).astype(jnp.int32), out, kv


class EagleProposer:
    def __init__(self, cfg, graphdef, state, spec_config, mesh, block_size: int,
                 max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int):
        self.cfg, self.spec_config, self.mesh = cfg, spec_config, mesh
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.plan = BucketPlan.build(max_num_batched_tokens, max_num_seqs)
        self._replicated = mesh_lib.replicated(mesh)
        self.graphdef, self.state = graphdef, state
        self._leaves, treedef = jax.tree.flatten(state)
        self.dtype = state["embed_tokens"].get_value().dtype    # not d2t's int32
        spec = AttentionSpec(sm_scale=cfg.arch.head_dim ** -0.5, mesh=mesh)
        args = (graphdef, treedef, spec)
        self._ingest = jax.jit(functools.partial(_ingest, *args), donate_argnums=(1,))
        self._decode = jax.jit(functools.partial(_decode, *args), donate_argnums=(1,))
        self.kv_caches = None

    @property
    def num_lookahead_tokens(self) -> int:
        return self.spec_config.num_speculative_tokens

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """EAGLE-3: the target layers whose entering residual streams target_hidden
        holds (in this order); () for EAGLE-1 (the final hidden state)."""
        return self.cfg.aux_layer_ids

    @classmethod
    def from_config(cls, engine_config, spec_config, target, target_num_blocks, mesh,
                    max_model_len: int, max_num_batched_tokens: int) -> "EagleProposer":
        """`target`: the target's LoadedModel (its embedding and head are shared)."""
        from jaxllm.models.eagle import load_eagle_head
        dtype = target.state["embed_tokens"].get_value().dtype
        cfg, graphdef, state = load_eagle_head(spec_config.model, spec_config.method, target,
                                               dtype, mesh_lib.param_shardings(mesh))
        proposer = cls(cfg, graphdef, state, spec_config, mesh, engine_config.cache.block_size,
                       max_model_len, max_num_batched_tokens,
                       engine_config.scheduler.max_num_seqs)
        if target_num_blocks is not None:
            proposer.initialize_kv_cache(target_num_blocks)
        return proposer

    def kv_bytes_per_block(self) -> int:
        return kv_cache.bytes_per_block(self.cfg.arch, self.block_size, self.dtype)

    def weight_bytes(self) -> int:
        """The head's own weights (the shared embedding/lm_head counted too)."""
        return kv_cache.device_bytes(self._leaves)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = kv_cache.allocate(
            self.cfg.arch, num_blocks, self.block_size, self.dtype,
            mesh_lib.kv_cache_sharding(self.mesh, self.cfg.arch.num_kv_heads),
            tp=self.mesh.size)

    def finish(self, request_ids) -> None:
        pass        # no per-request state (see the module docstring)

    # ------------------------------------------------------------ proposing
    def propose(self, requests, max_drafts, block_tables, target_hidden, scheduled,
                step_requests: dict) -> list[list[int]]:
        """Ingest the target step (`scheduled`, `step_requests` id -> Request, its
        `target_hidden`), then up to max_drafts[i] drafts for requests[i]."""
        rows, chunks = self._ingest_rows(scheduled, step_requests)
        if not chunks:
            return [[] for _ in requests]
        arrays, decode_only, s = input_batch.prepare_inputs(
            chunks, self.plan, self.block_size, self.max_blocks_per_seq, {})
        src = np.zeros(len(arrays["input_ids"]), np.int32)
        src[:len(rows)] = rows
        tokens, hidden, self.kv_caches = self._ingest(
            self._leaves, self.kv_caches, target_hidden, jax.device_put(src, self._replicated),
            StepInputs.pack(arrays, decode_only, self._replicated))
        index = {c.request_id: i for i, c in enumerate(chunks)}
        want = [(i, index[r.request_id], min(k, self._room(r, t)))
                for i, (r, k, t) in enumerate(zip(requests, max_drafts, block_tables))
                if k > 0 and r.request_id in index
                and chunks[index[r.request_id]].num_computed_tokens
                + len(chunks[index[r.request_id]].token_ids) == r.num_tokens - 1]
        want = [w for w in want if w[2] > 0]
        out = [[] for _ in requests]
        if not want:
            return out
        steps = [jnp.take(tokens, jnp.asarray([w[1] for w in want]))]
        sel = np.asarray([w[1] for w in want], np.int32)
        for j in range(1, max(w[2] for w in want)):
            arrays, s = self._decode_arrays(requests, want, block_tables, j)
            pad = np.zeros(s, np.int32)
            pad[:len(sel)] = sel
            tokens, hidden, self.kv_caches = self._decode(
                self._leaves, self.kv_caches, tokens, hidden, jax.device_put(pad, self._replicated),
                StepInputs.pack(arrays, True, self._replicated))
            sel = np.arange(len(want), dtype=np.int32)
            steps.append(tokens[:len(want)])
        got = np.stack([np.asarray(t) for t in jax.device_get(steps)], 1)
        for n, (i, _, k) in enumerate(want):
            out[i] = got[n, :k].tolist()
        return out

    def _room(self, req, table) -> int:
        n = req.num_tokens
        return min(self.max_model_len - n + 1,
                   min(len(table), self.max_blocks_per_seq) * self.block_size - n + 1)

    def _ingest_rows(self, scheduled, step_requests):
        """Rows of the target step to ingest (their index in target_hidden) and the
        head's chunks: each request's rows at positions p whose token p + 1 is known."""
        rows, chunks, off = [], [], 0
        for r in scheduled:
            tokens = step_requests[r.request_id].all_token_ids
            c, m = r.num_computed_tokens, len(r.token_ids)
            n = min(m, len(tokens) - 1 - c)      # p = c + j needs token p + 1
            if n > 0:
                rows.extend(range(off, off + n))
                chunks.append(ScheduledRequest(r.request_id, tokens[c + 1:c + 1 + n], c,
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
