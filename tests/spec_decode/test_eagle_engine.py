"""EAGLE end to end on the tiny random Llama (float32, CPU), with random EAGLE-3 and
EAGLE-1 heads written here: greedy output token-identical to speculation off with
chunked prefill and with preemption, n=2 with a stop string; every draft the
engine proposed equal to the head recomputed from scratch over the request's
tokens (so every target step's states reached the head, in order, async steps and
prefill chunks included); nothing compiles after the warm-up; and the target's and
a proposer's KV pools of one block count share the CPU budget."""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxllm import LLM
from jaxllm.config import CacheConfig
from jaxllm.models.loader import load_model
from jaxllm.runner import kv_cache
from test_spec_engine import ENGINE, GREEDY, VARIANTS, generate, prompts, sampled_params
from test_eagle_proposer import full_md, reference_drafts, target_aux

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_eagle import write_head  # noqa: E402

K = 3
CHECKED = ("chunked", "preempt")       # chunked: max_num_batched_tokens=16


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model("llama")[0]


@pytest.fixture(scope="module")
def heads(tiny_model, tmp_path_factory):
    _, hf = tiny_model("llama")
    out = {}
    for method in ("eagle3", "eagle"):
        folder = tmp_path_factory.mktemp(method)
        write_head(folder, hf.config.vocab_size, method, seed=3)
        out[method] = str(folder)
    return out


@pytest.fixture(scope="module")
def references(target):
    refs = {}
    for name in CHECKED:
        llm = LLM(target, **{**ENGINE, **VARIANTS[name]})
        ps = prompts(llm.llm_engine.arch.vocab_size)
        refs[name] = (ps, generate(llm, ps), generate(llm, ps, sampled_params(llm, ps)))
    return refs


def eagle_llm(target, heads, method, **extra):
    spec = {"method": method, "model": heads[method], "num_speculative_tokens": K}
    return LLM(target, **{**ENGINE, **extra}, speculative_config=spec)


def record_proposals(proposer) -> list:
    """Wrap propose: (the request's tokens then, its drafts) for each non-empty one."""
    seen, propose = [], proposer.propose

    def recording(requests, max_drafts, block_tables):
        drafts = propose(requests, max_drafts, block_tables)
        seen.extend((list(r.all_token_ids), d) for r, d in zip(requests, drafts) if d)
        return drafts

    proposer.propose = recording
    return seen


def target_states(loaded, tokens, layers):
    """What the head reads of the target over `tokens` from scratch: EAGLE-3 the aux
    layers' inputs, EAGLE-1 the final hidden state."""
    if layers:
        return target_aux(loaded, tokens, layers)
    model = nnx.merge(loaded.graphdef, loaded.state)
    pos, md = full_md(len(tokens))
    kv = kv_cache.allocate(loaded.arch, 2, 64, jnp.float32)
    from jaxllm.layers.attention import AttentionSpec
    return model(jnp.asarray(tokens), pos, kv, md,
                 AttentionSpec(sm_scale=loaded.arch.head_dim ** -0.5))[0]


# EAGLE-1 differs from EAGLE-3 in the head, not in the engine's bookkeeping, which
# the preemption case exercises: it runs with EAGLE-3 only (CI time).
@pytest.mark.parametrize("method, variant", [("eagle3", "chunked"), ("eagle3", "preempt"),
                                             ("eagle", "chunked")])
def test_output_identical_and_drafts_are_the_heads(target, heads, references, method,
                                                   variant):
    ps, greedy_ref, sampled_ref = references[variant]
    llm = eagle_llm(target, heads, method, **VARIANTS[variant])
    engine = llm.llm_engine
    proposer = engine.executor.proposer
    assert type(proposer).__name__ == "EagleProposer"
    assert engine.runner.hidden_layers == proposer.aux_layer_ids
    seen = record_proposals(proposer)
    assert generate(llm, ps) == greedy_ref
    if variant == "preempt":
        assert engine.scheduler.num_preemptions_total > 0
    stats = engine.engine_core.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_drafts > 0
    # Every proposal (spread over the run) is the head's greedy continuation computed
    # from scratch: its KV had every target step's rows, in order.
    loaded = load_model(target, "float32")
    for tokens, drafts in seen[::max(1, len(seen) // 6)]:
        states = target_states(loaded, tokens, proposer.aux_layer_ids)
        assert drafts == reference_drafts(proposer, states, tokens, len(drafts))
    assert generate(llm, ps, sampled_params(llm, ps)) == sampled_ref


def test_the_head_accepts_when_it_agrees(target, heads, references):
    """A head whose drafts are the target's own tokens is accepted (so acceptance is
    counted from the verify steps): replace its drafts by the reference's."""
    ps, greedy_ref, _ = references["chunked"]
    llm = eagle_llm(target, heads, "eagle3", **VARIANTS["chunked"])
    proposer = llm.llm_engine.executor.proposer
    truth = {tuple(p): p + g[0][0] for p, g in zip(ps, greedy_ref)}
    propose = proposer.propose

    def right(requests, max_drafts, block_tables):
        drafts = propose(requests, max_drafts, block_tables)     # the head still runs
        return [truth[tuple(r.prompt_token_ids)][r.num_tokens:r.num_tokens + len(d)]
                for r, d in zip(requests, drafts)]

    proposer.propose = right
    assert generate(llm, ps) == greedy_ref
    stats = llm.llm_engine.engine_core.spec_stats
    assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens > 0


def test_no_compilation_after_warm_up(target, heads):
    llm = eagle_llm(target, heads, "eagle3", enforce_eager=False)
    ps = prompts(llm.llm_engine.arch.vocab_size, n=6, seed=9)
    compiles = []
    listener = lambda name, *a, **k: (  # noqa: E731
        compiles.append(name) if "backend_compile" in name else None)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        generate(llm, ps)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert llm.llm_engine.engine_core.spec_stats.num_draft_tokens > 0
    assert compiles == []


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_both_pools_fit_the_cpu_budget(target, heads, method):
    budget = 300_000        # a few tens of blocks: below the max_num_seqs cap
    spec = {"model": target if method == "draft_model" else heads[method],
            "method": method, "num_speculative_tokens": K}
    llm = LLM(target, **{**ENGINE, "cpu_kv_cache_bytes": budget}, speculative_config=spec)
    ex = llm.llm_engine.executor
    proposer = ex.proposer
    pools = [ex.runner.kv_caches, proposer.kv_caches if method == "eagle3"
             else proposer.runner.kv_caches]
    counts = {x.shape[1] for pool in pools for x in jax.tree.leaves(pool)}
    assert counts == {ex.num_gpu_blocks}              # one block count, both pools
    per_block = sum(x.nbytes for pool in pools for x in jax.tree.leaves(pool)) // ex.num_gpu_blocks
    assert per_block == (kv_cache.bytes_per_block(ex.arch, 16, jnp.float32)
                         + proposer.kv_bytes_per_block())
    assert ex.num_gpu_blocks * per_block <= budget < (ex.num_gpu_blocks + 1) * per_block
    assert generate(llm, prompts(ex.arch.vocab_size, n=2)) is not None


def test_gpu_plan_leaves_room_for_the_draft(target):
    arch = load_model(target, "float32").arch
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.5)
    limit, peak, weights = 64 << 20, 8 << 20, 5 << 20
    alone = kv_cache.plan_num_blocks(arch, cache, jnp.float32, 128, 1 << 20, peak, limit)
    both = kv_cache.plan_num_blocks(arch, cache, jnp.float32, 128, 1 << 20, peak, limit,
                                    draft_per_block=4096, draft_weights=weights)
    # Each block costs both pools' bytes; the draft's weights come off the budget.
    assert both.num_blocks == kv_cache.stable_block_count(
        (limit // 2 - peak - weights) // (both.per_block + 4096))
    assert peak + weights + both.num_blocks * (both.per_block + 4096) <= limit // 2
    assert both.num_blocks < alone.num_blocks and both.draft_weights == weights
