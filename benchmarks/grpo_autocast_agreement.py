"""GRPO with its loss pass under bf16 autocast against fp32, same seed, over a whole run: does autocast change
where training goes? (issue #32's "an autocast agreement check over a whole GRPO run before a preset uses it";
the ES counterpart is es_compute_dtype_agreement.py.)

The runs and their scores come from one `deltalens sweep grpo` over the autocast setting, e.g. SmolLM2 at the
study's GRPO budget (40 steps of the `smollm2` preset):

    deltalens sweep grpo --model smollm2 --grid autocast=none,bf16 --steps 40 --eval-every 0 \\
        --out build/sweep-grpo-ac
    python benchmarks/grpo_autocast_agreement.py build/sweep-grpo-ac [--out FILE]

The sweep trains both points from the same seed (the weights, gradients and AdamW state fp32 in both; only the
loss pass's matmuls differ) and scores the base and both finals on the same validation problems with the same
sampling seed, so its "minus best" interval is the paired bf16-minus-fp32 difference (over problems, and over
training seeds when the sweep has several: `--seeds 0,1`). This script adds what the
sweep does not report, read from the two finished runs (nothing is trained or evaluated here):

- per training seed, bf16 minus fp32 validation Pass@1 with its paired interval over problems only, from the
  sweep's cached per-problem scores, and (two seeds or more) each dtype's seed-to-seed difference the same way:
  how far two runs of one setting land apart, which the interval over problems does not carry;
- per training seed, ||θ-θ0|| and ||θ-θ0||/||θ0|| of each run, their ratio, the cosine of the two updates and
  ||Δ_bf16 - Δ_fp32|| / ||Δ_fp32|| (0 and 1 when the two runs took the same steps);
- each run's per-step mean reward, KL, completion length and step seconds (metrics.jsonl), and their sums.

Prints JSON (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from es_compute_dtype_agreement import distances

from deltalens.analysis import stats
from deltalens.analysis.report import Cache, weights_hash
from deltalens.evaluation.passk import pass_at_k
from deltalens.io.runs import RunDir
from deltalens.tasks import get_task

POINTS = {"fp32": "none", "bf16": "bf16"}  # this script's names -> the sweep's autocast values


def point(sweep: dict, value: str) -> dict:
    """The sweep's point whose autocast is `value` (a one-line error when the sweep has none)."""
    for p in sweep["points"]:
        if str(p["values"].get("autocast")) == value:
            return p
    sys.exit(f"error: the sweep has no point with autocast={value} (points: "
             f"{', '.join(p['name'] for p in sweep['points'])})")


def cached_pass1(root: Path, sweep: dict, spec: str, chat: str) -> list[float]:
    """Per-problem Pass@1 of `spec` (a run's final weights) as the sweep scored it: its DIR/cache entry, keyed as
    `deltalens.study.sweep.score_task` keys it (`chat`: the runs' chat_template setting as given, e.g. auto;
    nothing is evaluated here)."""
    ev, cache = sweep["evaluation"], Cache(root / "cache")
    key = cache.key("sweep-eval", weights=weights_hash(spec), task=get_task(sweep["task"]).spec,
                    limit=ev["problems"], samples=ev["samples"], temperature=ev["temperature"],
                    chat=chat, split="validation")
    f = root / "cache" / f"{key}.json"
    if not f.is_file():
        sys.exit(f"error: {root}/cache has no score of {spec} (rerun the sweep to the end)")
    return [pass_at_k(n, c, 1) for n, c in json.loads(f.read_text())["per_problem"]]


def paired(a: list[float], b: list[float]) -> dict:
    """a minus b over the same problems: the sweep's paired bootstrap (deltalens.analysis.stats), problems only."""
    e = stats.paired_effect([a], [b], trained_base=True, span=1.0)
    return {"mean": round(e["estimate"], 4), "ci95": [round(x, 4) for x in e["ci"]]}


def run_facts(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward_mean" in r]
    step_s = [r["timing"]["iteration_s"] for r in rows]
    return {"steps": len(rows), "train_seconds": round(sum(step_s), 1), "median_step_s": round(statistics.median(step_s), 2),
            "reward_mean_per_step": [round(r["reward_mean"], 4) for r in rows],
            "kl_per_step": [round(r.get("kl", 0.0), 6) for r in rows],
            "completion_length_per_step": [round(r.get("completion_length", 0.0), 2) for r in rows],
            "compute_dtype": rows[-1].get("compute_dtype") if rows else None}


def per_seed(root: Path, sweep: dict, runs: dict, seeds: list[int]) -> dict:
    """Per training seed, bf16 minus fp32 validation Pass@1 with its interval over problems only; and, with two
    seeds or more, each dtype's later seed minus its first (how far two runs of one setting land apart)."""
    chat = json.loads(min((root / "runs").glob("*/config.json")).read_text())["chat_template"]
    p1 = {seed: {k: cached_pass1(root, sweep, str(RunDir(r).weights()), chat) for k, r in by.items()}
          for seed, by in runs.items()}
    out = {f"bf16_minus_fp32 seed {s}": paired(p1[s]["bf16"], p1[s]["fp32"]) for s in seeds}
    for s in seeds[1:]:
        for k in POINTS:
            out[f"{k} seed {s} minus seed {seeds[0]}"] = paired(p1[s][k], p1[seeds[0]][k])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", help="a finished `deltalens sweep grpo --grid autocast=none,bf16` directory")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(args.sweep)
    if not (root / "sweep.json").is_file():
        sys.exit(f"error: {root} has no sweep.json (run the sweep first, to the end)")
    sweep = json.loads((root / "sweep.json").read_text())
    pts = {k: point(sweep, v) for k, v in POINTS.items()}
    seeds = [s for s in pts["fp32"]["seeds"] if s in pts["bf16"]["seeds"]]
    runs = {seed: {k: root / "runs" / f"{p['name']}-s{seed}" for k, p in pts.items()} for seed in seeds}
    for run in (r for by_dtype in runs.values() for r in by_dtype.values()):
        if not (run / "state.json").is_file():
            sys.exit(f"error: {run} is not a finished run")
    # bf16 minus fp32 from the sweep's paired "minus best" figures (one of the two is the best point)
    if sweep["best"] == pts["bf16"]["name"]:
        diff, ci = -pts["fp32"]["vs_best"], [-pts["fp32"]["vs_best_ci"][1], -pts["fp32"]["vs_best_ci"][0]]
    else:
        diff, ci = pts["bf16"]["vs_best"], list(pts["bf16"]["vs_best_ci"])
    ev = sweep["evaluation"]
    res = {"date": time.strftime("%Y-%m-%d"), "sweep": str(root), "model": sweep["model"], "task": sweep["task"],
           "preset": sweep["preset"], "fixed": sweep["fixed"], "evaluation": ev,
           "validation_pass_at_1": {"base": round(sweep["base"]["pass_at_1"], 4),
                                    **{k: {"mean": round(p["pass_at_1"], 4), "minus_base": round(p["vs_base"], 4),
                                           "minus_base_ci": [round(x, 4) for x in p["vs_base_ci"]]}
                                       for k, p in pts.items()}},
           "bf16_minus_fp32": {"mean": round(diff, 4), "ci95": [round(x, 4) for x in ci],
                               "zero_in_interval": ci[0] <= 0 <= ci[1]},
           "seeds": seeds,
           "per_seed": per_seed(root, sweep, runs, seeds),
           "distance": {f"seed {seed}": distances(sweep["model"], runs[seed]) for seed in seeds},
           "runs": {f"{k} seed {seed}": run_facts(r) for seed in seeds for k, r in runs[seed].items()}}
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
