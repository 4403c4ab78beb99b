"""Draft-model speculation: a small model of the same tokenizer proposes k tokens per
request, greedily, and the target verifies them (vLLM's `speculative_config.model`).

The draft is a second ModelRunner on the draft's weights, driven with synthetic
SchedulerOutputs. Its KV pool has as many blocks, of the same size, as the target's
and is indexed by the target's block ids: the target's block tables (which the
scheduler extends by k lookahead slots per running request) are valid for it, so it
needs no allocator of its own.

Draft KV bookkeeping, per request: the tokens the draft has fed at each position.
A position's draft KV is valid while the token fed there is the token the request
has there now (accepted drafts stay valid; a rejected draft's position is fed again
with the target's token). A wrong draft KV would only lower acceptance, never the
output: the target decides every token.

One propose() is 1 + (k - 1) launches when every request's new tokens fit one step
(the usual case: after a verify step a request feeds 1 token, 2 when all k drafts
were accepted): one ragged step feeding each request's tokens without draft KV and
sampling d0, then k - 1 one-token decode steps whose input is the previous step's
sample, taken on the device (the runner's placeholder rows), so nothing is read
back until all k steps are launched. Longer feeds (a new prompt) are chunked to the
runner's token budget in steps before it.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from dataclasses import dataclass, field

from jaxllm.engine.scheduler import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Drafts are greedy whatever the request asks: the target's sample-and-compare
# acceptance is exact for a point-mass proposal.
_GREEDY = SamplingParams(temperature=0.0)


class _GreedyRequest:
    """What ModelRunner reads of a request: greedy, no penalties, no logprobs."""
    sampling_params = _GREEDY
    prompt_token_ids = ()
    output_token_ids = ()

    def __init__(self, request_id: str):
        self.request_id = request_id


class _GreedyRequests(dict):
    def __missing__(self, request_id):
        return _GreedyRequest(request_id)


@dataclass
class _DraftState:
    num_valid: int = 0          # leading tokens known equal to the request's tokens
    tail: list[int] = field(default_factory=list)   # fed after those, not yet confirmed

    def valid_prefix(self, tokens: list[int]) -> int:
        """Positions whose draft KV holds the request's token, below len - 1 (the
        newest token is always fed: its logits give d0)."""
        v, cap = self.num_valid, len(tokens) - 1
        if v >= cap:
            return cap
        for t in self.tail:
            if v >= cap or tokens[v] != t:
                break
            v += 1
        return v


@dataclass
class _Feed:
    """One request's part of a propose(): tokens[start:] are fed at positions start..."""
    request_id: str
    tokens: list[int]           # all_token_ids (not copied)
    start: int
    k: int
    block_table: list[int]


class DraftModelProposer:
    def __init__(self, runner, spec_config):
        self.runner = runner
        self.spec_config = spec_config
        self._states: dict[str, _DraftState] = {}
        self._requests = _GreedyRequests()
        self._seeds = defaultdict(int)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the next step's that propose() writes into."""
        return self.spec_config.num_speculative_tokens

    @classmethod
    def from_config(cls, engine_config, spec_config, target_arch, target_num_blocks,
                    mesh, max_model_len: int,
                    max_num_batched_tokens: int) -> "DraftModelProposer":
        """Load the draft (spec_config.model, an HF folder or GGUF file) onto `mesh`
        and build its runner, with a pool of `target_num_blocks` blocks (None: none
        yet; initialize_kv_cache, after sizing the target's pool with
        kv_bytes_per_block and weight_bytes). The draft takes the target's dtype
        setting and step budget; its own quantization_config, if any."""
        from jaxllm.models.loader import load_model
        from jaxllm.parallel import mesh as mesh_lib
        from jaxllm.runner.model_runner import ModelRunner
        from jaxllm.spec_decode.config import check_draft_vocab
        mc = engine_config.model
        load_format = "dummy" if mc.load_format == "dummy" else "auto"
        loaded = load_model(spec_config.model, mc.dtype, load_format,
                            mesh_lib.param_shardings(mesh), mc.seed, tp=mesh.size)
        check_draft_vocab(target_arch.vocab_size, loaded.arch.vocab_size, spec_config.model)
        config = engine_config.replace(
            model=dataclasses.replace(mc, model=spec_config.model, quantization=None))
        runner = ModelRunner(config, loaded, mesh, max_model_len, max_num_batched_tokens)
        proposer = cls(runner, spec_config)
        if target_num_blocks is not None:
            proposer.initialize_kv_cache(target_num_blocks)
        return proposer

    # ------------------------------------------------------------ sizing
    def kv_bytes_per_block(self) -> int:
        """Device bytes one block of the draft's pool takes (per device, as
        kv_cache.plan_num_blocks counts the target's)."""
        from jaxllm.parallel.mesh import pool_kv_heads
        from jaxllm.runner.kv_cache import bytes_per_block, cache_dtype
        r, arch = self.runner, self.runner.arch
        per_block = bytes_per_block(arch, r.block_size, cache_dtype(r.config.cache, r.model_dtype))
        return per_block * pool_kv_heads(arch.num_kv_heads, r.mesh.size) // (
            arch.num_kv_heads * r.mesh.size)

    def weight_bytes(self) -> int:
        """Device bytes the draft keeps beside its pool (per device): its weights and
        its runner's logits buffers, one per sequence bucket (LogitsBuffers; ~260 MB
        at a 128k vocabulary), which the target's step peak does not hold."""
        from jaxllm.runner.kv_cache import device_bytes
        return device_bytes(self.runner.params) + self.runner.logits_bufs.total_bytes()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the draft's pool: `num_blocks`, the target's block count."""
        r = self.runner
        r.config = r.config.replace(cache=dataclasses.replace(
            r.config.cache, num_gpu_blocks_override=num_blocks))
        r.initialize_kv_cache()

    def warm_up(self) -> float:
        """Compile (or load) the draft runner's buckets; the seconds it took."""
        return self.runner.warm_up()

    # ------------------------------------------------------------ proposing
    def propose(self, requests, max_drafts: list[int],
                block_tables: list[list[int]]) -> list[list[int]]:
        """Up to max_drafts[i] greedy draft tokens for requests[i] (0: none, and its
        state is left as it was). block_tables[i] must cover positions up to
        len(all_token_ids) - 1 + max_drafts[i]."""
        drafts: list[list[int]] = [[] for _ in requests]
        feeds = {}
        for i, (req, k, table) in enumerate(zip(requests, max_drafts, block_tables)):
            feed = self._feed(req, k, table)
            if feed is not None:
                feeds[i] = feed
        order = list(feeds)
        group = self.runner.plan.max_seqs
        for g in range(0, len(order), group):
            rows = order[g:g + group]
            for i, d in zip(rows, self._propose_group([feeds[i] for i in rows])):
                drafts[i] = d
        return drafts

    def finish(self, request_ids) -> None:
        """Forget finished or preempted requests (a preempted one's blocks change)."""
        for rid in request_ids:
            self._states.pop(rid, None)

    def _feed(self, req, k: int, table: list[int]) -> _Feed | None:
        tokens = req.all_token_ids
        n, r = len(tokens), self.runner
        table = table[:r.max_blocks_per_seq]
        # Decode step j feeds position n - 1 + j (j < k): keep it inside the model's
        # length and the block table.
        k = min(k, r.max_model_len - n + 1, len(table) * r.block_size - n + 1)
        if k <= 0:
            return None
        state = self._states.setdefault(req.request_id, _DraftState())
        return _Feed(req.request_id, tokens, state.valid_prefix(tokens), k, table)

    def _propose_group(self, feeds: list[_Feed]) -> list[list[int]]:
        """Drafts for at most max_seqs requests: chunked catch-up steps, the step
        sampling d0, then the decode steps."""
        budget = self.runner.plan.token_buckets[-1]
        lengths = [len(f.tokens) - f.start for f in feeds]
        tails = _tail_lengths(lengths, budget)
        for scheduled in _head_steps(feeds, lengths, tails, budget):
            self._launch(scheduled)
        handles = [self._launch([
            ScheduledRequest(f.request_id, f.tokens[len(f.tokens) - t:], len(f.tokens) - t,
                             f.block_table, True, 0) for f, t in zip(feeds, tails)])]
        for j in range(1, max(f.k for f in feeds)):
            handles.append(self._launch([
                ScheduledRequest(f.request_id, [PLACEHOLDER_TOKEN_ID], len(f.tokens) - 1 + j,
                                 f.block_table, True, 0) for f in feeds if f.k > j]))
        drafts: dict[str, list[int]] = {f.request_id: [] for f in feeds}
        for handle in handles:
            for rid, res in self.runner.get_output(handle)[0].items():
                drafts[rid].append(res.token_id)
        out = []
        for f in feeds:
            d = drafts[f.request_id]
            # All tokens are fed now; of the drafts, all but the last.
            self._states[f.request_id] = _DraftState(len(f.tokens), d[:-1])
            out.append(d)
        return out

    def _launch(self, scheduled: list[ScheduledRequest]):
        out = SchedulerOutput(scheduled=scheduled,
                              num_batched_tokens=sum(len(r.token_ids) for r in scheduled))
        return self.runner.execute_model(out, self._requests, self._seeds)


def _tail_lengths(lengths: list[int], budget: int) -> list[int]:
    """How many of each request's last tokens go in the step that samples d0: all,
    while the step's budget lasts, and at least one each (the rest is fed before)."""
    left = budget - len(lengths)
    tails = []
    for n in lengths:
        extra = min(n - 1, max(left, 0))
        left -= extra
        tails.append(1 + extra)
    return tails


def _head_steps(feeds: list[_Feed], lengths: list[int], tails: list[int], budget: int):
    """The catch-up steps before the sampling one: each request's tokens before its
    tail, in order, at most `budget` tokens a step and one chunk per request a step
    (a second chunk would attend to KV its own step writes)."""
    done = [0] * len(feeds)
    heads = [n - t for n, t in zip(lengths, tails)]
    while any(d < h for d, h in zip(done, heads)):
        left, scheduled = budget, []
        for i, f in enumerate(feeds):
            take = min(heads[i] - done[i], left)
            if take <= 0:
                continue
            start = f.start + done[i]
            scheduled.append(ScheduledRequest(f.request_id, f.tokens[start:start + take],
                                              start, f.block_table, False, 0))
            done[i] += take
            left -= take
            if left == 0:
                break
        yield scheduled
