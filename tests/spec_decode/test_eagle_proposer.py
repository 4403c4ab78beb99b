"""EagleProposer (a random EAGLE-3 head on the tiny Llama): its drafts from paged,
incrementally ingested target steps against the head recomputed from scratch over
the whole sequence, across a prefill and a verify step that rejects drafts."""
from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import ScheduledRequest
from jaxllm.layers.attention import AttentionMetadata, AttentionSpec
from jaxllm.models.loader import load_model
from jaxllm.parallel.mesh import make_mesh
from jaxllm.runner import kv_cache
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.eagle import EagleProposer

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_eagle import write_head  # noqa: E402

BS, TABLE = 16, [3, 1, 4, 2]


def full_md(n: int):
    """One sequence of n tokens in a fresh pool of 2 blocks of 64 (block 1)."""
    pos = np.arange(n, dtype=np.int32)
    return jnp.asarray(pos), AttentionMetadata(
        slot_mapping=jnp.asarray(64 + pos), block_tables=jnp.asarray([[1]]),
        seq_lens=jnp.asarray([n]), query_start_loc=jnp.asarray([0, n]))


def target_aux(loaded, tokens, layers):
    model = nnx.merge(loaded.graphdef, loaded.state)
    pos, md = full_md(len(tokens))
    kv = kv_cache.allocate(loaded.arch, 2, 64, jnp.float32)
    spec = AttentionSpec(sm_scale=loaded.arch.head_dim ** -0.5)
    return model(jnp.asarray(tokens), pos, kv, md, spec, aux_layers=layers)[2]


def reference_drafts(proposer, aux, tokens, k):
    """Greedy drafts recomputed from scratch: pairs (token p+1, feature p), the
    features the target's for known tokens, then the head's own."""
    model = nnx.merge(proposer.graphdef, proposer.state)
    spec = AttentionSpec(sm_scale=proposer.cfg.arch.head_dim ** -0.5)
    ids = list(tokens[1:])
    feats = model.combine_hidden_states(aux[:len(tokens) - 1])
    drafts = []
    for _ in range(k):
        pos, md = full_md(len(ids))
        kv = kv_cache.allocate(proposer.cfg.arch, 2, 64, jnp.float32)
        final, out, _ = model(jnp.asarray(ids), feats, pos, kv, md, spec)
        d = int(jnp.argmax(model.compute_logits(final[-1:]), -1)[0])
        drafts.append(d)
        ids.append(d)
        feats = jnp.concatenate([feats, out[-1:]])
    return drafts


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    folder, hf = tiny_model("llama")
    head = tmp_path_factory.mktemp("eagle3")
    write_head(head, hf.config.vocab_size, "eagle3", seed=3)
    loaded = load_model(folder, "float32")
    config = EngineConfig(model=ModelConfig(model=folder, dtype="float32", max_model_len=64),
                          cache=CacheConfig(block_size=BS),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32))
    spec = SpeculativeConfig(method="eagle3", model=str(head), num_speculative_tokens=4)
    proposer = EagleProposer.from_config(config, spec, loaded, 8, make_mesh(1), 64, 32)
    return loaded, hf, proposer


def test_drafts_match_recomputed_head(setup):
    loaded, hf, proposer = setup
    layers = proposer.aux_layer_ids
    prompt = np.random.default_rng(5).integers(0, hf.config.vocab_size, 11).tolist()
    req = Request("e", prompt, SamplingParams(temperature=0.0))
    # Prefill: the target ran the prompt (rows 0..10) and sampled token 11.
    aux = target_aux(loaded, prompt, layers)
    req.append_output_token(7)
    step = [ScheduledRequest("e", prompt, 0, TABLE, True, 0)]
    drafts = proposer.propose([req], [4], [TABLE], aux, step, {"e": req})[0]
    assert drafts == reference_drafts(proposer, target_aux(loaded, req.all_token_ids, layers),
                                      req.all_token_ids, 4)
    # Verify step: rows [token 11, d0, d1, d2] at positions 11..14; d0 accepted, then
    # the target's own token (not d1); rows of d1, d2 are not ingested.
    fed = [req.all_token_ids[-1]] + drafts[:3]
    aux = target_aux(loaded, req.all_token_ids + drafts[:3], layers)[11:]
    req.append_output_token(drafts[0])
    req.append_output_token((drafts[1] + 1) % hf.config.vocab_size)
    step = [ScheduledRequest("e", fed, 11, TABLE, True, 0)]
    drafts = proposer.propose([req], [3], [TABLE], aux, step, {"e": req})[0]
    assert drafts == reference_drafts(proposer, target_aux(loaded, req.all_token_ids, layers),
                                      req.all_token_ids, 3)
