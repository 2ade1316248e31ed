"""The figures of docs/reproduction.md's "Claim 7 on SmolLM2 with α scaled by N" from the five evaluations here:
Pass@1 and Pass@32 of the base (mean of 3 sampling seeds), ES (N = 16), two-point ES (N = 2), and the paired
differences with percentile intervals over the 100 problems (`stats.problem_bootstrap`, 40,000 replicates).

    python docs/smollm2-claim7-2026-12-06/compare.py
"""

import json
from pathlib import Path

from deltalens.analysis import stats

HERE = Path(__file__).parent / "evaluations"
NAMES = ("base-seed0", "base-seed1", "base-seed2", "es-s0", "es-2pt-s0")
METRICS = {"Pass@1": lambda p: p["correct"] / p["n"], "Pass@32": lambda p: float(p["correct"] > 0)}  # n = 32


def mean(x):
    return sum(x) / len(x)


def diff(a, b):
    return round(mean(a) - mean(b), 4), stats.problem_bootstrap(a, b, resamples=40000)


problems = {n: json.loads((HERE / f"{n}.json").read_text())["per_problem"] for n in NAMES}
for metric, f in METRICS.items():
    v = {n: [f(p) for p in problems[n]] for n in NAMES}
    base = [mean(x) for x in zip(*(v[f"base-seed{i}"] for i in range(3)))]
    print(metric, "base", round(mean(base), 4), "ES - base", diff(v["es-s0"], base),
          "two-point - base", diff(v["es-2pt-s0"], base), "two-point - ES", diff(v["es-2pt-s0"], v["es-s0"]))
