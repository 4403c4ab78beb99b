"""bench_quant_matmul.py's projection filter (--projs): a bad name is refused in one
line naming the flag, before any matmul is built."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import bench_quant_matmul  # noqa: E402


def test_projs_refuses_an_unknown_projection(capsys):
    with pytest.raises(SystemExit) as e:
        bench_quant_matmul.main(["--projs", "down,lm_head"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("--projs down,lm_head: each of qkv, o, gate_up, down")


def test_projs_runs_only_those(monkeypatch, capsys):
    """--projs down: rows for down only (the case itself stubbed: no device time)."""
    seen = []

    def case(kind, m, n, k, *rest):
        seen.append((kind, m, n, k))
        return {"compile_s": 0.0, "us": 1.0, "tflops": 0.0}
    monkeypatch.setattr(bench_quant_matmul, "case", case)
    monkeypatch.delenv("OUT", raising=False)
    bench_quant_matmul.main(["--projs", "down", "--kinds", "bf16", "--ms", "1,8",
                             "--variants", "default"])
    assert seen == [("bf16", 1, 4096, 14336), ("bf16", 8, 4096, 14336)]
