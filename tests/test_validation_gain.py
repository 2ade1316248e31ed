"""benchmarks/validation_gain.py's coverage block: known answers (the script itself runs real evaluations)."""

from __future__ import annotations

from support import load_benchmark


def _ev(counts):
    return {"per_problem": [{"correct": c, "n": 16} for c in counts]}


def test_coverage_counts_problems_lost_and_gained_at_a_quarter_of_the_samples():
    vg = load_benchmark("validation_gain")
    base = _ev([16, 4, 3, 0, 0, 1, 8])
    final = _ev([16, 1, 0, 4, 0, 2, 2])
    c = vg.coverage(base, final, 16)
    # lost: base >= 4 and final <= 1 -> problem 1 (4 -> 1); problem 2 (3 -> 0) is under the bar, 6 (8 -> 2) above 1
    # gained: base <= 1 and final >= 4 -> problem 3 (0 -> 4); problem 5 (1 -> 2) is not
    assert (c["lost"], c["gained"]) == (1, 1)
    assert c["pass_at_s"] == {"base": 5 / 7, "final": 5 / 7}
    assert "4/16" in c["rule"]
    assert vg.coverage(_ev([2, 0]), _ev([0, 2]), 8)["lost"] == 1  # S = 8: the bar is 2 correct
