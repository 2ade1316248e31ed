"""benchmarks/bench_grpo.py's `Phases`: resident memory attributed to the innermost labelled phase."""

from __future__ import annotations

import time

from support import load_benchmark, resident_block

MB = 1 << 20


def test_a_block_held_in_an_inner_phase_is_that_phases_rise_not_the_outers():
    phases = load_benchmark("bench_grpo").Phases(every=0.01)
    try:
        with phases("outer"):
            time.sleep(0.05)
            with phases("inner"):
                block = resident_block(200 * MB)
                time.sleep(0.2)
                del block  # unmapped: resident size falls back before the outer phase resumes
            time.sleep(0.1)
        with phases("inner"):  # a second occurrence, holding nothing: the largest rise is kept
            time.sleep(0.05)
    finally:
        phases.stop()
    out = phases.summary()
    assert out["inner"]["occurrences"] == 2 and out["outer"]["occurrences"] == 1
    assert out["inner"]["rise_kb"] >= 190 * 1024  # the 200 MB it held, sampled while held
    assert out["outer"]["rise_kb"] < 50 * 1024  # the block was freed before the outer phase was on top again
    assert out["inner"]["peak_rss_kb"] - out["outer"]["peak_rss_kb"] >= 150 * 1024
    assert next(iter(out)) == "inner"  # sorted by peak, highest first
