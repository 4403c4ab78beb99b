"""The sampler's host inputs built from row entries kept across steps
(runner/sampling_rows.py) equal those built afresh from SamplingParams, and the model
runner keeps a request's entry only while the request is scheduled."""
from types import SimpleNamespace

import numpy as np
import pytest

from jaxllm.runner import sampling_rows
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.sampling_params import SamplingParams

V = 1000
PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=7),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.7, top_k=500, logprobs=2),
    SamplingParams(temperature=0.9, seed=-3, repetition_penalty=1.2, presence_penalty=0.5),
    SamplingParams(temperature=0.5, min_tokens=3, stop_token_ids=[5, 6]),
]
FALLBACK = [11, 12, 13, 14, 15, 2**64 - 1]
PROMPTS = [[1, 2], [3], [4, 5, 6], [7], [8, 9, 10, 11, 12], [13]]
OUTPUTS = [[20], [21, 22], [], [23], [24, 24, 25], [26]]


def _same(a, b):
    (md_a, flags_a), (md_b, flags_b) = a, b
    assert flags_a == flags_b
    for field in ("rows", "prompt_tokens", "output_tokens", "blocked_tokens"):
        np.testing.assert_array_equal(getattr(md_a, field), getattr(md_b, field))


@pytest.mark.parametrize("subset", [range(6), [0], [1, 3], [0, 2, 4], [5, 1]])
def test_cached_entries_build_what_from_params_builds(subset):
    params = [PARAMS[i] for i in subset]
    entries = [sampling_rows.row_entry(PARAMS[i], V, FALLBACK[i]) for i in subset]
    for step in range(4):        # the same entries, later output indices
        indices = [step * 2 + i for i in range(len(params))]
        fresh = sampling_rows.from_params(
            params, indices, [PROMPTS[i] for i in subset], [OUTPUTS[i] for i in subset], 8,
            V, fallback_seeds=[FALLBACK[i] for i in subset], eos_token_ids=(2,))
        cached = sampling_rows.build(entries, indices, 8, lambda: [PROMPTS[i] for i in subset],
                                     lambda: [OUTPUTS[i] for i in subset], (2,))
        _same(cached, fresh)


def test_flags_follow_the_rows():
    greedy = sampling_rows.build([sampling_rows.row_entry(PARAMS[0], V, 1)] * 3, [0] * 3, 4,
                                 list, list)[1]
    assert greedy.all_greedy and not greedy.use_top_k_top_p_min_p
    small = sampling_rows.build([sampling_rows.row_entry(PARAMS[1], V, 1)], [0], 4, list, list)
    assert small[1].small_top_k and small[1].use_top_k_top_p_min_p
    # top_k 500 is past the block path's limit: one such row takes the general path.
    mixed = sampling_rows.build([sampling_rows.row_entry(PARAMS[i], V, 1) for i in (1, 3)],
                                [0, 0], 4, list, list)[1]
    assert not mixed.small_top_k and mixed.num_logprobs > 0
    # min_tokens: its stop tokens blocked below it, not at it.
    entry = sampling_rows.row_entry(PARAMS[5], V, 1)
    md, flags = sampling_rows.build([entry], [2], 4, list, list, (2,))
    assert flags.use_penalties and sorted(md.blocked_tokens[0][md.blocked_tokens[0] >= 0]) == [
        2, 5, 6]
    md, flags = sampling_rows.build([entry], [3], 4, list, list, (2,))
    assert not flags.use_penalties and (md.blocked_tokens < 0).all()


def test_token_lists_are_read_only_with_penalties():
    def boom():
        raise AssertionError("read without penalties")
    sampling_rows.build([sampling_rows.row_entry(PARAMS[i], V, 1) for i in (0, 1, 3)],
                        [0, 0, 0], 4, boom, boom)
    with pytest.raises(ValueError, match="token lists"):
        sampling_rows.build([sampling_rows.row_entry(PARAMS[4], V, 1)], [0], 4,
                            lambda: None, lambda: None)


def _request(rid, i):
    return SimpleNamespace(request_id=rid, sampling_params=PARAMS[i],
                           prompt_token_ids=PROMPTS[i], output_token_ids=OUTPUTS[i])


def test_runner_keeps_an_entry_while_its_request_is_scheduled():
    runner = SimpleNamespace(_row_entries={}, arch=SimpleNamespace(vocab_size=V),
                             _eos_ids=lambda: (2,))
    seeds = {"a": 1, "b": 2, "c": 3}

    def step(ids_and_params, output_index):
        reqs = [_request(rid, i) for rid, i in ids_and_params]
        scheduled = [SimpleNamespace(request_id=q.request_id, output_index=output_index,
                                     spec_token_ids=[]) for q in reqs]
        md, _ = ModelRunner._sampling_metadata(runner, scheduled, reqs, 8, seeds)
        return md

    step([("a", 1), ("b", 4)], 0)
    first = dict(runner._row_entries)
    md = step([("a", 1), ("c", 3)], 5)
    assert runner._row_entries["a"] is first["a"]          # kept, not rebuilt
    assert set(runner._row_entries) == {"a", "c"}          # b's dropped with b
    np.testing.assert_array_equal(md.output_index[:2], [5, 5])
    fresh = sampling_rows.from_params([PARAMS[1], PARAMS[3]], [5, 5], None, None, 8, V,
                                         fallback_seeds=[1, 3], eos_token_ids=(2,))[0]
    np.testing.assert_array_equal(md.rows, fresh.rows)


def test_a_request_id_used_again_gets_its_own_row():
    runner = SimpleNamespace(_row_entries={}, arch=SimpleNamespace(vocab_size=V),
                             _eos_ids=lambda: (2,))
    scheduled = [SimpleNamespace(request_id="a", output_index=0, spec_token_ids=[])]
    ModelRunner._sampling_metadata(runner, scheduled, [_request("a", 1)], 8, {"a": 1})
    # A later request under the same id: other params, then the same params object
    # with another seed; each time the row is the new request's.
    for i, seed in ((3, 1), (3, 9)):
        md, flags = ModelRunner._sampling_metadata(runner, scheduled, [_request("a", i)], 8,
                                                   {"a": seed})
        fresh = sampling_rows.from_params([PARAMS[i]], [0], None, None, 8, V,
                                          fallback_seeds=[seed], eos_token_ids=(2,))
        np.testing.assert_array_equal(md.rows, fresh[0].rows)
        assert flags == fresh[1]


def test_rows_of_one_request_share_an_entry_and_equal_params_keep_it(monkeypatch):
    """Verify rows (several per request in one step) build one entry; a multi-host
    follower's params, unpickled anew each step, equal but not identical, keep it."""
    import copy
    built = []
    real = sampling_rows.row_entry
    monkeypatch.setattr(sampling_rows, "row_entry",
                        lambda *a, **k: built.append(a) or real(*a, **k))
    runner = SimpleNamespace(_row_entries={}, arch=SimpleNamespace(vocab_size=V),
                             _eos_ids=lambda: (2,))
    req = _request("a", 1)
    rows = [SimpleNamespace(request_id="a", output_index=4 + j, spec_token_ids=[])
            for j in range(3)]
    md, _ = ModelRunner._sampling_metadata(runner, rows, [req] * 3, 8, {"a": 1})
    np.testing.assert_array_equal(md.output_index[:3], [4, 5, 6])
    assert len(built) == 1
    follower_req = copy.deepcopy(req)
    assert follower_req.sampling_params is not req.sampling_params
    ModelRunner._sampling_metadata(runner, rows, [follower_req] * 3, 8, {"a": 1})
    assert len(built) == 1
