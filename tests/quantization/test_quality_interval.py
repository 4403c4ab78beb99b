"""scripts/quant_quality.py's interval: a paired block bootstrap of the perplexity ratio.
The figures it qualifies are in docs/benchmarks.md; this checks the arithmetic."""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import quant_quality  # noqa: E402


def test_identical_runs_give_a_zero_interval():
    lps = list(np.random.default_rng(0).normal(-2.5, 1.0, 700))
    assert quant_quality.ratio_interval(lps, lps) == (0.0, 0.0)


def test_a_constant_shift_is_exact_and_pairing_removes_the_text_spread():
    base = np.random.default_rng(1).normal(-2.5, 2.0, 700)     # a wildly varying text
    lo, hi = quant_quality.ratio_interval(list(base - 0.02), list(base))
    assert math.isclose(lo, math.exp(0.02) - 1, rel_tol=1e-9)
    assert math.isclose(hi, math.exp(0.02) - 1, rel_tol=1e-9)
    ppl = quant_quality.perplexity(list(base - 0.02)) / quant_quality.perplexity(list(base))
    assert math.isclose(ppl - 1, lo, rel_tol=1e-9)


def test_the_interval_holds_the_point_and_narrows_with_length():
    rng = np.random.default_rng(2)
    widths = []
    for n in (700, 7000):
        base = rng.normal(-2.5, 1.0, n)
        q = base - rng.normal(0.02, 0.1, n)
        lo, hi = quant_quality.ratio_interval(list(q), list(base))
        point = quant_quality.perplexity(list(q)) / quant_quality.perplexity(list(base)) - 1
        assert lo < point < hi
        widths.append(hi - lo)
    assert widths[1] < 0.5 * widths[0]
