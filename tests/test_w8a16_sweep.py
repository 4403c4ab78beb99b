"""scripts/w8a16_sweep.py: its candidates within the fp8 kernel's rules (so a sweep
spends no row on a refusal), the pick reading only the kernel's rows, and a bad
projection refused."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import w8a16_sweep  # noqa: E402

from pallas_kernels import w8a16_mgpu as w8  # noqa: E402


def test_candidates_are_settings_the_kernel_takes():
    for proj, cands in w8a16_sweep.CANDIDATES.items():
        n, k = w8a16_sweep.bqm.SHAPES[proj]
        for st in cands:
            cols, tile_n = st.get("cols", w8.B), st.get("tile_n", 128)
            splits = st.get("k_splits") or w8.default_k_splits(n, k, tile_n)
            assert k % (splits * cols) == 0 and n % tile_n == 0, (proj, st)
            assert w8.smem_bytes(tile_n, 16, st.get("stages", 4), cols) <= w8.common.SMEM_BYTES
        assert {} not in cands          # the defaults run first and last anyway


def test_pick_reads_the_kernels_rows():
    rows = [{"kind": "mgpu_fp8", "settings": {}, "m": 16, "us": 30.0},
            {"kind": "mgpu_fp8", "settings": {"k_splits": 4}, "m": 16, "us": 25.0},
            {"kind": "mgpu_w4", "settings": {"k_splits": 8}, "m": 16, "us": 1.0}]
    means, best = w8a16_sweep.pick(rows, [16], 0.97, kind="mgpu_fp8")
    assert best == {"k_splits": 4} and set(means) == {"{}", '{"k_splits": 4}'}


def test_bad_projection_refused():
    with pytest.raises(SystemExit):
        w8a16_sweep.main(["--projs", "gate"])


def test_verdict_compares_the_layer_with_xla(monkeypatch, tmp_path):
    """The sweep writes 'ahead' only where its projections' best settings sum under
    XLA's four at 16 rows (the engines run on that with ENGINE_IF_AHEAD=1)."""
    def fake(kernel_us):
        def main(argv):
            kinds = argv[argv.index("--kinds") + 1]
            projs = argv[argv.index("--projs") + 1].split(",")
            if "w8a16_fp8" in kinds:         # the peer table
                return [{"kind": "w8a16_fp8", "proj": p, "m": 16, "us": 10.0} for p in projs]
            return [{"kind": "mgpu_fp8", "settings": {}, "m": 16, "us": kernel_us, "proj": p}
                    for p in projs]
        return main
    monkeypatch.setenv("OUT", str(tmp_path))
    for us, verdict in ((9.0, "ahead"), (11.0, "behind")):
        monkeypatch.setattr(w8a16_sweep.bqm, "main", fake(us))
        assert w8a16_sweep.main(["--projs", "gate_up,down"]) == 0
        assert (tmp_path / "w8a16_verdict.txt").read_text() == verdict
