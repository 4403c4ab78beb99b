"""The executor's draft proposers behind one interface:

    propose(requests, max_drafts, block_tables) -> list[list[int]]
    finish(request_ids) -> None      # finished or preempted: forget their state
    num_lookahead_tokens             # slots past the step's that it writes KV into

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


def build_proposer(executor, spec_config):
    """The proposer `spec_config.method` names, for an executor whose KV pool is
    allocated (a draft model's pool matches its block count)."""
    if spec_config.method == "ngram":
        return NgramDrafts(spec_config)
    if spec_config.method == "draft_model":
        from jaxllm.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer.from_config(
            executor.config, spec_config, executor.arch, executor.runner.num_blocks,
            executor.mesh, executor.max_model_len, executor.max_num_batched_tokens)
    raise NotImplementedError(f"speculative_config method {spec_config.method!r} is not "
                              "built yet")
