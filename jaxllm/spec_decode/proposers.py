"""The executor's draft proposers behind one interface:

    propose(requests, max_drafts, block_tables) -> list[list[int]]
    finish(request_ids) -> None      # finished or preempted (swapped too): forget them
    num_lookahead_tokens             # slots past the step's that it writes KV into
    kv_bytes_per_block(), weight_bytes(), initialize_kv_cache(num_blocks), warm_up()
                                     # a model of its own (draft, EAGLE head): its pool
                                     # has the target's block count, sized with it
    ingest(target_hidden, scheduled, step_requests, sampled)
                                     # EAGLE: every target step as it is read back

`requests`: the running requests that decode next (all_token_ids: prompt and
outputs; the target has KV for all but the last). `block_tables`: theirs, covering
`num_lookahead_tokens` positions past the next step's (a draft model writes its own
KV there, in its own pool indexed by the same block ids).
"""
from __future__ import annotations


class NgramDrafts:
    """Prompt lookup (ngram_proposer.py) on the host; no KV, no lookahead slots."""
    num_lookahead_tokens = 0

    def __init__(self, spec_config):
        from jaxllm.spec_decode.ngram_proposer import NgramProposer
        self.proposer = NgramProposer(spec_config)

    def propose(self, requests, max_drafts, block_tables) -> list[list[int]]:
        return self.proposer.propose_batch([r.all_token_ids for r in requests], max_drafts,
                                           [r.request_id for r in requests])

    def finish(self, request_ids) -> None:
        self.proposer.forget(request_ids)


def target_hidden_layers(spec_config, target_arch) -> tuple[int, ...] | None:
    """What the target's steps return for the proposer (ModelRunner's
    hidden_layers): an EAGLE-3 head's target layers, () for EAGLE-1 (the final
    hidden state), None for every other method (the step returns nothing more)."""
    if spec_config is None or spec_config.method not in ("eagle", "eagle3"):
        return None
    import os

    from jaxllm.models.eagle import eagle_config
    from jaxllm.models.loader import read_hf_config
    return eagle_config(read_hf_config(spec_config.model), spec_config.method, target_arch,
                        os.path.join(spec_config.model, "config.json")).aux_layer_ids


def build_proposer(executor, spec_config, target):
    """The proposer `spec_config.method` names, before the KV pools are sized: a model
    of its own has no pool until initialize_kv_cache(the target's block count).
    `target`: the target's LoadedModel (an EAGLE head shares its embedding)."""
    if spec_config.method == "ngram":
        return NgramDrafts(spec_config)
    args = (executor.mesh, executor.max_model_len, executor.max_num_batched_tokens)
    if spec_config.method == "draft_model":
        from jaxllm.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer.from_config(executor.config, spec_config, executor.arch,
                                              None, *args)
    from jaxllm.spec_decode.eagle import EagleProposer
    return EagleProposer.from_config(executor.config, spec_config, target, None, *args)
