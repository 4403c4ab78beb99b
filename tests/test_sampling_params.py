"""SamplingParams: defaults, normalisation and validation (vLLM semantics)."""

import pytest

from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput, make_logprobs_entry
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.include_stop_str_in_output and not p.ignore_eos
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


def test_stop_is_normalized_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0
    assert not SamplingParams(top_k=-1).uses_filters


def test_greedy_resets_filters_and_sampling_types():
    p = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)
    assert p.is_greedy and p.sampling_type is SamplingType.GREEDY
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0) and not p.uses_filters
    assert SamplingParams(seed=7).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=1e-6).is_greedy


def test_feature_properties():
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=-0.5).uses_penalties
    assert not SamplingParams().uses_penalties
    assert SamplingParams(min_p=0.05).uses_filters and SamplingParams(top_p=0.9).uses_filters
    assert SamplingParams(stop=["ab", "abcd"]).stop_buffer_length == 3
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True).stop_buffer_length == 0


def test_limits_accept_what_clients_send():
    SamplingParams(n=128, seed=(1 << 63) - 1, stop=["x" * 1024] * 128,
                   stop_token_ids=list(range(1024)))
    SamplingParams(seed=-(1 << 63))


def test_boundaries_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, presence_penalty=-2.0,
                   frequency_penalty=2.0, max_tokens=1, min_tokens=1, logprobs=MAX_LOGPROBS,
                   prompt_logprobs=0)
    p = SamplingParams(max_tokens=None, min_tokens=1000)
    assert p.max_tokens is None


@pytest.mark.parametrize("field,value", [
    ("n", 0),
    ("temperature", -0.1),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("repetition_penalty", 0.0),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("prompt_logprobs", 21),
    ("stop", ["ok", ""]),
    ("stop_token_ids", [-3]),
    ("n", 129),
    ("seed", 10 ** 40),
    ("seed", -(1 << 63) - 1),
    ("stop", [f"s{i}" for i in range(129)]),
    ("stop", ["x" * 1025]),
    ("stop_token_ids", list(range(1025))),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_outputs_dataclasses():
    c = CompletionOutput(0, "hi", [1, 2], None, None)
    assert not c.finished() and c.stop_reason is None
    c.finish_reason = "stop"
    r = RequestOutput("r0", "p", [5], None, [c], finished=True)
    assert r.finished and c.finished() and r.num_cached_tokens == 0 and r.metrics is None


def test_make_logprobs_entry_keeps_sampled_token():
    top_ids, top_lps = [4, 9, 2], [-0.1, -2.0, -3.0]
    inside = make_logprobs_entry(9, -2.0, 2, top_ids, top_lps, 2, decode=str)
    assert list(inside) == [9, 4]
    assert inside[9] == Logprob(-2.0, 2, "9") and inside[4] == Logprob(-0.1, 1, "4")
    outside = make_logprobs_entry(7, -5.0, 11, top_ids, top_lps, 2)
    assert list(outside) == [7, 4, 9] and outside[7].rank == 11
    assert make_logprobs_entry(7, -5.0, 11, top_ids, top_lps, 0) == {7: Logprob(-5.0, 11)}
