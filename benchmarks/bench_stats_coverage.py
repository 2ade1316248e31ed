"""Coverage of the study's effect intervals over few training seeds (deltalens.analysis.stats), simulated.

A study compares a method trained with S seeds against the base sampled with a few seeds, on the same test
problems. Two scenarios, --trials simulated studies each, true effect +0.03:
  seeds_differ   every training seed shifts all problems by N(0, 0.05); per-problem noise N(0, 0.02);
                 200 problems, base with 2 sampling seeds (the seed spread dominates)
  seeds_alike    Pass@1 estimated from 32 Bernoulli samples per problem, 100 problems with rates U(0, 1),
                 base with 3 sampling seeds, no seed effect (the problems dominate); rates clipped at 1,
                 so the true effect is 0.0296, which no interval here resolves from 0.03
and three intervals (95%, percentile):
  t_draw         `hierarchical_bootstrap`: problems resampled, the method's seed part drawn from a Student-t
  seed_resample  the earlier version: problems and seeds both resampled with replacement
  problems_only  `problem_bootstrap`: seeds averaged, problems resampled
It prints one JSON object: per scenario and S, the share of studies whose interval holds the truth, and the
mean width.

    python benchmarks/bench_stats_coverage.py --trials 300 --seeds 2,3,5    # ~20 s on 2 cores
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from deltalens.analysis import stats

TRUTH = 0.03


def seed_resample(m: np.ndarray, b: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """The earlier hierarchical bootstrap: seeds of each side and problems resampled with replacement."""
    rng = np.random.default_rng(seed)
    out = np.empty(resamples)
    for r in range(resamples):
        ws = np.bincount(rng.integers(0, len(m), len(m)), minlength=len(m)) / len(m)
        wt = np.bincount(rng.integers(0, len(b), len(b)), minlength=len(b)) / len(b)
        d = ws @ m - wt @ b
        out[r] = d[rng.integers(0, d.size, d.size)].mean()
    return float(np.quantile(out, 0.025)), float(np.quantile(out, 0.975))


def study(scenario: str, n_seeds: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(method (S, P), base (S_b, P)) of one simulated study."""
    if scenario == "seeds_differ":
        b_i = rng.random(200)
        base = b_i + rng.normal(0, 0.02, (2, 200))
        method = b_i + TRUTH + rng.normal(0, 0.05, (n_seeds, 1)) + rng.normal(0, 0.02, (n_seeds, 200))
        return method, base
    p = rng.random(100)
    base = (rng.random((3, 100, 32)) < p[None, :, None]).mean(2)
    method = (rng.random((n_seeds, 100, 32)) < np.clip(p + TRUTH, 0, 1)[None, :, None]).mean(2)
    return method, base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=300, help="simulated studies per scenario and seed count")
    ap.add_argument("--seeds", default="2,3,5", help="training seed counts S to simulate")
    ap.add_argument("--resamples", type=int, default=500, help="bootstrap replicates per interval")
    args = ap.parse_args()
    intervals = {"t_draw": lambda m, b, t: stats.hierarchical_bootstrap(m, b, resamples=args.resamples, seed=t),
                 "seed_resample": lambda m, b, t: seed_resample(m, b, args.resamples, t),
                 "problems_only": lambda m, b, t: stats.problem_bootstrap(m, b, resamples=args.resamples, seed=t)}
    result = {"trials": args.trials, "resamples": args.resamples, "truth": TRUTH, "scenarios": {}}
    for scenario in ("seeds_differ", "seeds_alike"):
        for s in (int(x) for x in args.seeds.split(",")):
            rng = np.random.default_rng(11)
            hits = {k: 0 for k in intervals}
            width = {k: 0.0 for k in intervals}
            for t in range(args.trials):
                m, b = study(scenario, s, rng)
                for k, f in intervals.items():
                    lo, hi = f(m, b, t)
                    hits[k] += lo <= TRUTH <= hi
                    width[k] += (hi - lo) / args.trials
            result["scenarios"][f"{scenario}:S={s}"] = {
                k: {"coverage": hits[k] / args.trials, "mean_width": round(width[k], 5)} for k in intervals}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
