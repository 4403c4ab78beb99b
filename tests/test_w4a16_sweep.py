"""scripts/w4a16_sweep.py: which setting it picks from a sweep's rows (the defaults'
runs averaged, a candidate taken only under the margin and only with every row
count), its candidates within the kernel's rules, and a bad projection refused."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import w4a16_sweep  # noqa: E402

from pallas_kernels import w4a16_mgpu as w4  # noqa: E402


def _row(settings, m, us, kind="mgpu_w4"):
    return {"kind": kind, "settings": settings, "m": m, "us": us}


def test_pick_takes_a_candidate_only_under_the_margin():
    rows = [_row({}, 1, 30.0), _row({}, 16, 34.0), _row({}, 1, 32.0), _row({}, 16, 36.0),
            _row({"tiles": 7, "k_splits": 8}, 1, 26.0), _row({"tiles": 7, "k_splits": 8}, 16, 30.0),
            _row({"tiles": 2}, 1, 20.0),                       # no 16-row figure: not a pick
            _row({}, 1, 5.0, kind="bf16")]
    means, best = w4a16_sweep.pick(rows, [1, 16], 0.97)
    assert means["{}"] == pytest.approx(33.0)                  # both default runs
    assert best == {"k_splits": 8, "tiles": 7}                 # 28 < 0.97 x 33
    assert '{"tiles": 2}' not in means
    _, best = w4a16_sweep.pick(rows, [1, 16], 0.8)             # 28 > 0.8 x 33
    assert best is None


def test_candidates_are_settings_the_kernel_takes():
    """Every candidate divides its projection's tiles and groups and fits shared
    memory at 16 rows, so a sweep spends no row on a refusal."""
    for proj, cands in w4a16_sweep.CANDIDATES.items():
        n, k = w4a16_sweep.bqm.SHAPES[proj]
        for st in cands:
            tiles, splits = st.get("tiles", 1), st["k_splits"]
            gps, stages = st.get("groups_per_step", 1), st.get("stages", 4)
            assert n // 128 % tiles == 0 and k // w4.GROUP % splits == 0, (proj, st)
            assert k // w4.GROUP // splits % gps == 0, (proj, st)
            assert w4.smem_bytes(128, 16, stages, gps, tiles) <= w4.common.SMEM_BYTES


def test_bad_projection_refused():
    with pytest.raises(SystemExit):
        w4a16_sweep.main(["--projs", "gate"])
