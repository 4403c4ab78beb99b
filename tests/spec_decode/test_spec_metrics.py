"""SpecDecodingStats arithmetic, the vllm:spec_decode_* Prometheus series and log
line, and the stats snapshot that carries the counters to the front end.
(Named test_spec_metrics: tests/engine/test_metrics.py has the plain name.)"""
from __future__ import annotations

import logging
import math
import pickle
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxllm.engine.core_proc import engine_stats
from jaxllm.metrics import EngineMetrics, StatLogger
from jaxllm.spec_decode.metrics import SpecDecodingStats


def test_observe_counts_drafts_tokens_and_positions():
    s = SpecDecodingStats(4)
    assert s.num_accepted_tokens_per_pos == [0, 0, 0, 0]
    s.observe(4, 2)           # drafts 0 and 1 accepted
    s.observe(4, 4)
    s.observe(3, 0)           # fewer drafts than k (the proposer found fewer)
    s.observe(0, 0)           # no proposal: not counted
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 11, 6)
    assert s.num_accepted_tokens_per_pos == [2, 2, 1, 1]
    assert s.acceptance_rate == pytest.approx(6 / 11)
    assert s.mean_acceptance_length == pytest.approx(1 + 6 / 3)
    assert s.acceptance_rate_per_pos() == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert SpecDecodingStats.new(2) == SpecDecodingStats(2)
    assert math.isnan(SpecDecodingStats(2).acceptance_rate)


@pytest.mark.parametrize("drafts, accepted", [(5, 1), (2, 3), (2, -1)])
def test_observe_refuses_impossible_counts(drafts, accepted):
    with pytest.raises(ValueError, match="observe"):
        SpecDecodingStats(4).observe(drafts, accepted)


def test_snapshot_is_a_copy():
    s = SpecDecodingStats(2)
    s.observe(2, 1)
    snap = s.snapshot()
    s.observe(2, 2)
    assert snap.num_drafts == 1 and snap.num_accepted_tokens_per_pos == [1, 0]
    assert s.num_accepted_tokens_per_pos == [2, 1]
    assert pickle.loads(pickle.dumps(snap)) == snap


@dataclass
class _Stats:       # the fields of llm_engine.EngineStats that the collector reads
    num_running: int = 1
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


def _engine(spec):
    return SimpleNamespace(get_stats=_Stats, engine_core=SimpleNamespace(spec_stats=spec))


def _samples(metrics: EngineMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name, sample.labels.get("position")] = (sample.value, sample.labels)
    return out, text


def test_prometheus_series_under_vllm_names():
    spec = SpecDecodingStats(3)
    spec.observe(3, 2)
    spec.observe(2, 1)
    m = EngineMetrics("tiny")
    m.update_stats(engine_stats(_engine(spec)))
    s, text = _samples(m)
    assert s["vllm:spec_decode_num_drafts_total", None][0] == 2
    assert s["vllm:spec_decode_num_draft_tokens_total", None][0] == 5
    assert s["vllm:spec_decode_num_accepted_tokens_total", None][0] == 3
    per_pos = [s["vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p)][0]
               for p in range(3)]
    assert per_pos == [2, 1, 0]
    labels = s["vllm:spec_decode_num_accepted_tokens_per_pos_total", "0"][1]
    assert labels == {"model_name": "tiny", "engine": "0", "position": "0"}
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in text
    assert "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter" in text
    # Counted on after the snapshot: the exported numbers are the snapshot's.
    spec.observe(3, 3)
    assert _samples(m)[0]["vllm:spec_decode_num_drafts_total", None][0] == 2


def test_no_spec_series_without_speculation():
    m = EngineMetrics("tiny")
    stats = engine_stats(_engine(None))
    assert not hasattr(stats, "spec_decoding")
    m.update_stats(stats)
    assert "spec_decode" not in _samples(m)[1]
    m.update_stats(None)            # before the first snapshot
    assert "spec_decode" not in _samples(m)[1]


def test_stat_logger_spec_line_over_the_interval(caplog):
    spec = SpecDecodingStats(2)
    m = EngineMetrics("tiny")
    log = StatLogger(m)
    spec.observe(2, 2)
    spec.observe(2, 0)
    m.update_stats(engine_stats(_engine(spec)))
    with caplog.at_level(logging.INFO, logger="jaxllm.stats"):
        log.log()
        spec.observe(2, 1)          # the next interval: one proposal, one accepted
        m.update_stats(engine_stats(_engine(spec)))
        log.log()
        log.log()                   # nothing drafted since: no spec line
    lines = [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()]
    assert len(lines) == 2
    assert "Mean acceptance length: 2.00" in lines[0]
    assert "Per-position acceptance rate: 0.500, 0.500" in lines[0]
    assert "Accepted: 2 tokens, Drafted: 4 tokens" in lines[0]
    assert "Avg Draft acceptance rate: 50.0%" in lines[0]
    assert "Mean acceptance length: 2.00" in lines[1]
    assert "Per-position acceptance rate: 1.000, 0.000" in lines[1]
    assert "Accepted: 1 tokens, Drafted: 2 tokens" in lines[1]
