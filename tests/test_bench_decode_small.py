"""scripts/bench_decode_small.py on the CPU (the kernel in interpret mode): it checks a
setting against the reference, times it, and names a bad case or setting in one line."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import bench_decode_small  # noqa: E402


def test_one_case_and_setting_run_and_are_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench_decode_small.main(["--cases", "8:1:40", "--layers", "2", "--width", "4",
                                    "--settings", '[{"interpret": true}]']) == 0
    got = json.loads((tmp_path / "bench_decode_small.json").read_text())
    assert got["cases"] == ["8:1:40"] and got["layers"] == 2
    assert got["rows"]['{"interpret": true}'][0] > 0
    assert got["max_err"] < 1e-2          # bf16 queries and pool against the f32 reference
    assert "8:1:40" in capsys.readouterr().out


def test_kv_write_mode_times_both_forms_and_checks_the_pools(tmp_path, monkeypatch):
    """--kv-write: the KV write kernel then decode, against decode_and_write; each
    checked against ref_decode_and_write (pools equal) before it is timed."""
    monkeypatch.setenv("OUT", str(tmp_path))
    settings = '[{"fold": false, "interpret": true}, {"fold": true, "interpret": true}]'
    assert bench_decode_small.main(["--cases", "8:2:40", "--layers", "2", "--width", "4",
                                    "--kv-write", "--copies", "2",
                                    "--settings", settings]) == 0
    got = json.loads((tmp_path / "bench_decode_small.json").read_text())
    assert got["kv_write"] and all(r[0] > 0 for r in got["rows"].values())
    assert got["max_err"] < 1e-2          # inf if decode_and_write's pools differed


@pytest.mark.parametrize("argv,message", [
    (["--cases", "8:9:40"], "needs 0 < L <= S"),
    (["--cases", "8:1"], "is not S:L:CTX"),
    (["--settings", "{"], "--settings: not JSON"),
    (["--settings", '{"spread": true}'], "a JSON list of objects expected"),
    (["--cases", "8:1:600", "--width", "4"], "needs more than --width 4 blocks"),
    (["--copies", "0"], "--copies 0: at least 1"),
    (["--layers", "0"], "--layers 0: at least 1"),
    (["--settings", '[{"fold": true}]'], '"fold" goes with --kv-write'),
    (["--kv-write", "--settings", '[{}]'], '"fold" goes with --kv-write'),
])
def test_bad_arguments_are_named(argv, message):
    with pytest.raises(SystemExit, match=message):
        bench_decode_small.main(["--layers", "1"] + argv)


def test_pool_copies_keep_two_l2s_of_kv_between_reads():
    per_call = 32 * 1 * 128 * 8 * 128 * 2 * 2            # 8:1:128, bf16: 16.8 MB a call
    assert bench_decode_small.auto_copies(1, 128, 32, 2) == -(-2 * (60 << 20) // per_call)
    assert bench_decode_small.auto_copies(64, 600, 32, 2) == 1
    assert bench_decode_small.auto_copies(1, 16, 32, 1) == 8          # capped


def test_without_kv_write_the_pools_are_not_returned():
    """Pools returned unchanged from the timed jit would be copied on every call."""
    import jax
    sets = bench_decode_small.make_inputs(8, 1, 40, 1, 4, jax.numpy.bfloat16)
    out = jax.jit(lambda *a: bench_decode_small.chained({"interpret": True}, *a))(*sets)
    assert out[1] is None and out[2] is None
