"""DraftModelProposer on tiny random Llamas (float32, CPU): its greedy drafts against
HF greedy decoding of the draft, across propose() calls that accept a prefix of the
drafts, reject one, chunk a long prompt and skip requests; the vocab check."""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from jaxllm.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from jaxllm.engine.request import Request
from jaxllm.models.loader import read_hf_config
from jaxllm.models.registry import arch_from_hf_config
from jaxllm.parallel.mesh import make_mesh
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.draft_model import DraftModelProposer


def _root_conftest():
    """tests/conftest.py by its path: the name `conftest` may be another folder's
    (tests/server/conftest.py) once the whole suite is collected."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "jaxllm_tests_root_conftest", Path(__file__).parents[1] / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_hf_config = _root_conftest().make_hf_config

BUDGET = 16            # the draft runner's max_num_batched_tokens: a 40-token prompt is chunked
MAX_MODEL_LEN = 128
BLOCKS_PER_SEQ = MAX_MODEL_LEN // 16


def spec(model: str, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=model, num_speculative_tokens=k)


def build(target: str, draft: str, num_blocks: int = 40) -> DraftModelProposer:
    config = EngineConfig(
        model=ModelConfig(model=target, dtype="float32", max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET),
        enforce_eager=True)
    arch = arch_from_hf_config(read_hf_config(target), target)
    return DraftModelProposer.from_config(config, spec(draft), arch, num_blocks, make_mesh(1),
                                          MAX_MODEL_LEN, BUDGET)


def hf_greedy(model, tokens: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens),
                             dtype=torch.long), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(tokens):].tolist()


def table(slot: int) -> list[int]:
    """Request slot's blocks (block 0 is the pool's null block)."""
    return list(range(1 + slot * BLOCKS_PER_SEQ, 1 + (slot + 1) * BLOCKS_PER_SEQ))


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0.0))


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def self_draft(target):
    """The target as its own draft: drafts must be the target's greedy continuation."""
    folder, _ = target
    return build(folder, folder)


def prompts(vocab: int):
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab, n).tolist() for n in (5, 40, 11)]   # 40 > BUDGET


def test_self_draft_is_greedy_continuation_across_acceptance(target, self_draft):
    _, hf = target
    ps = prompts(hf.config.vocab_size)
    ref = [p + hf_greedy(hf, p, 40) for p in ps]
    # Each round: tokens known per request, drafts asked, drafts then accepted. The
    # target's next token after `a` accepted drafts is its greedy one, ref[...].
    known = [len(p) + 1 for p in ps]       # prompt + the target's first sampled token
    rounds = [([4, 2, 3], [2, 0, 3]),      # a < k - 1: a fed draft's KV stays valid
              ([4, 0, 3], [4, 0, 1]),      # all accepted (2 tokens to feed); one skipped
              ([1, 3, 4], [0, 3, 4]),
              ([4, 4, 4], [3, 1, 0])]
    reqs = [request(f"s{i}", r[:n]) for i, (r, n) in enumerate(zip(ref, known))]
    for ks, accepted in rounds:
        drafts = self_draft.propose(reqs, ks, [table(i) for i in range(len(reqs))])
        for i, (r, k, a) in enumerate(zip(reqs, ks, accepted)):
            n = r.num_tokens
            assert drafts[i] == ref[i][n:n + k], (i, ks)
            for t in ref[i][n:n + min(a, k) + 1]:   # k = 0: a plain decode step
                r.append_output_token(t)
    self_draft.finish([r.request_id for r in reqs])


def test_draft_bytes_count_its_logits_buffers(self_draft):
    """What the target's KV sizing leaves room for: the draft's weights and every one
    of its logits buffers, which stay on the device between steps; at least as many
    bytes as the buffers a run has left there."""
    r = self_draft.runner
    self_draft.propose([request("bytes", [1, 2, 3])], [2], [table(0)])
    self_draft.finish(["bytes"])
    buckets = r.logits_bufs.seq_buckets
    weights = sum(x.nbytes for x in jax.tree.leaves(r.params))
    assert self_draft.weight_bytes() == weights + 4 * r.arch.vocab_size * sum(buckets)
    held = sum(b.nbytes for b in r.logits_bufs.buffers.values())
    assert 0 < held <= self_draft.weight_bytes() - weights


def test_rejected_draft_is_fed_again(target, self_draft):
    """The target disagrees with draft 1: the draft's KV there must be rewritten."""
    _, hf = target
    p = prompts(hf.config.vocab_size)[0]
    ref = hf_greedy(hf, p, 8)
    r = request("rej", p + ref[:1])
    assert self_draft.propose([r], [4], [table(0)])[0] == ref[1:5]
    wrong = (ref[2] + 1) % hf.config.vocab_size      # accepted d0, then not d1
    r.append_output_token(ref[1])
    r.append_output_token(wrong)
    expect = hf_greedy(hf, r.all_token_ids, 6)
    assert self_draft.propose([r], [4], [table(0)])[0] == expect[:4]
    # Speculation off for two steps (plain decoding), the first token not draft 0:
    # the draft's KV there, and at the next position, must be rewritten.
    r.append_output_token((expect[0] + 1) % hf.config.vocab_size)
    r.append_output_token(expect[1])
    expect = hf_greedy(hf, r.all_token_ids, 3)
    assert self_draft.propose([r], [3], [table(0)])[0] == expect
    self_draft.finish(["rej"])


def test_finish_forgets_draft_kv(target, self_draft):
    """A preempted request comes back with other blocks: after finish() its tokens
    are fed again there (without it, the draft would read the new blocks' KV)."""
    _, hf = target
    p = prompts(hf.config.vocab_size)[2]
    ref = hf_greedy(hf, p, 12)
    r = request("pre", p + ref[:1])
    assert self_draft.propose([r], [3], [table(1)])[0] == ref[1:4]
    for t in ref[1:5]:
        r.append_output_token(t)
    self_draft.finish(["pre"])
    other = request("junk", p[::-1] + ref[:1])      # fills table(2)'s blocks with other KV
    self_draft.propose([other], [3], [table(2)])
    self_draft.finish(["junk"])
    assert self_draft.propose([r], [3], [table(2)])[0] == ref[5:8]
    self_draft.finish(["pre"])


@pytest.fixture(scope="module")
def one_layer_draft(target, tmp_path_factory):
    """The target's first layer, embeddings and head, as an HF folder."""
    import transformers as tf
    folder, hf = target
    cfg = make_hf_config("llama")
    cfg.num_hidden_layers = 1
    torch.manual_seed(0)
    small = tf.LlamaForCausalLM(cfg).eval()
    missing, _ = small.load_state_dict(hf.state_dict(), strict=False)
    assert not missing
    out = str(tmp_path_factory.mktemp("draft-1layer"))
    small.save_pretrained(out)
    return out, small


def test_first_layers_draft_matches_its_own_greedy(target, one_layer_draft):
    folder, hf = target
    draft_folder, small = one_layer_draft
    proposer = build(folder, draft_folder)
    ps = prompts(hf.config.vocab_size)[:2]
    ref = [p + hf_greedy(hf, p, 1) for p in ps]        # the target's first token
    reqs = [request(f"d{i}", r) for i, r in enumerate(ref)]
    drafts = proposer.propose(reqs, [4, 4], [table(0), table(1)])
    assert drafts == [hf_greedy(small, r.all_token_ids, 4) for r in reqs]
    # The target accepts 2 of request 0's drafts and then says something else.
    reqs[0].append_output_token(drafts[0][0])
    reqs[0].append_output_token(drafts[0][1])
    reqs[0].append_output_token((drafts[0][2] + 1) % hf.config.vocab_size)
    reqs[1].append_output_token((drafts[1][0] + 7) % hf.config.vocab_size)
    drafts = proposer.propose(reqs, [3, 2], [table(0), table(1)])
    assert drafts == [hf_greedy(small, reqs[0].all_token_ids, 3),
                      hf_greedy(small, reqs[1].all_token_ids, 2)]


def test_vocab_mismatch_is_one_line(target, tmp_path):
    import transformers as tf
    folder, _ = target
    cfg = make_hf_config("llama")
    cfg.vocab_size = 300
    tf.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        build(folder, str(tmp_path))
    msg = str(err.value)
    assert "\n" not in msg and "300" in msg and "311" in msg, msg
