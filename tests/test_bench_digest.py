"""scripts/bench_h200.py: its digest comparison (where two runs' greedy tokens part, the
largest logprob difference before that, and a clear error for a result without one),
the latency peer it prints and --profile-shapes."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import bench_h200  # noqa: E402


def _save(path, tokens, logprobs, key="digest"):
    path.write_text(json.dumps({key: {"tokens": tokens, "logprobs": logprobs}}))
    return str(path)


def test_equal_prefix_and_logprob_difference_over_the_shared_tokens(tmp_path):
    a = _save(tmp_path / "a.json", [[1, 2, 3], [4, 5, 6]], [[-0.1, -0.2, -0.3]] * 2)
    b = _save(tmp_path / "b.json", [[1, 2, 9], [4, 5, 6]],
              [[-0.1, -0.25, -3.0], [-0.1, -0.2, -0.35]])
    got = bench_h200.compare_digests(a, b)
    # Prompt 0 parts at token 2: its -3.0 there is not compared; prompt 1's 0.05 is.
    assert got["equal_prefix"] == [2, 3] and got["tokens_each"] == 3
    assert got["max_logprob_diff"] == pytest.approx(0.05)


def test_a_result_without_a_digest_is_named(tmp_path):
    a = _save(tmp_path / "a.json", [[1]], [[-0.1]])
    b = _save(tmp_path / "latency.json", [[1]], [[-0.1]], key="latency")
    with pytest.raises(SystemExit, match="latency.json has no `digest` result"):
        bench_h200.compare_digests(a, b)


def test_latency_peer_only_at_its_batch_size(capsys):
    """vLLM's CI latency (the printed peer) is for 8 prompts; another --batch-size
    prints none."""
    base = {"model": "m", "device": "d", "tp": 1, "startup_s": 1.0,
            "latency": {"latency_ms_median": 500.0}}
    bench_h200.print_table({**base, "batch_size": 8})
    assert "vLLM H200 CI 833 ms" in capsys.readouterr().out
    bench_h200.print_table({**base, "batch_size": 64})
    out = capsys.readouterr().out
    assert "vLLM" not in out and "batch 64: no peer" in out


def test_profile_shapes_named_or_refused():
    got = bench_h200.profile_shapes("decode b1 ctx600, prefill 4x1024")
    want = ("decode b1 ctx600", "prefill 4x1024")
    assert got == {k: bench_h200.PROFILE_SHAPES[k] for k in want}
    with pytest.raises(bench_h200.argparse.ArgumentTypeError,
                       match="'decode b2': one of decode b1 ctx600"):
        bench_h200.profile_shapes("decode b2")
