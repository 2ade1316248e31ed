"""ES in bf16 compute against fp32 compute, same seed: does the compute dtype change where training goes?
(issue #32's "an ES run of 10 iterations in bf16 compute vs fp32 ... validation Pass@1 and ||θ-θ0|| within
their intervals").

    python benchmarks/es_compute_dtype_agreement.py [--model smollm2] [--iterations 10] [--limit 100]
        [--samples 16] [--dir build/es-dtype] [--out FILE]

For each compute dtype (fp32, then bf16) it trains `deltalens train es MODEL --preset auto --seed 0
--iterations I --compute-dtype D` into DIR/D (resumed where a run is there but unfinished: the runs are
resumable, and a finished one is reused), then evaluates each final model and the base with `deltalens
eval --split validation --limit L --samples S` (T = 0.6, seed 0, compute dtype auto: one and the same for
every evaluation, so that only training differs; bf16 evaluation's own agreement with fp32 is
bench_generation.py's). The master weights are fp32 in both runs: only the members'
generations (and so the rewards, the z-scores and the update) can differ.

Reported (JSON, also to --out):
- per run: validation Pass@1 with its standard error over problems, its difference from the base;
- bf16 minus fp32 Pass@1 with the paired SE over problems (the same problems, the same sampling seed), and
  whether it lies within 2 SE;
- ||θ-θ0|| and ||θ-θ0||/||θ0|| per run (fp32 sums over every floating-point tensor), their ratio, the cosine
  of the two updates and ||Δ_bf16 - Δ_fp32|| / ||Δ_fp32||: 0 and 1 when the two runs took the same steps;
- each run's training seconds (config.json to state.json) and its per-iteration mean rewards.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DTYPES = ("fp32", "bf16")


def sh(*args: str) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def deltalens(*args: str) -> None:
    sh(sys.executable, "-m", "deltalens.cli.main", *args)


def finished(run: Path, iterations: int) -> bool:
    state = run / "state.json"
    return state.is_file() and json.loads(state.read_text()).get("iteration", 0) >= iterations


def train(model: str, run: Path, dtype: str, iterations: int) -> None:
    if finished(run, iterations):
        print(f"{run}: finished, reused", flush=True)
    elif (run / "config.json").is_file():
        deltalens("train", "es", "--resume", str(run))
    else:
        deltalens("train", "es", "--model", model, "--preset", "auto", "--seed", "0", "--iterations",
                  str(iterations), "--compute-dtype", dtype, "--out", str(run))


def evaluate(spec: str, out: Path, limit: int, samples: int, task: str | None = None) -> dict:
    if not out.is_file():
        deltalens("eval", spec, "--split", "validation", "--limit", str(limit), "--samples", str(samples),
                  "--k", "1", "--temperature", "0.6", "--seed", "0", "--compute-dtype", "auto",
                  *(("--task", task) if task else ()), "--json", str(out))
    doc = json.loads(out.read_text())
    (ev,) = doc["evals"].values()
    return ev


def rates(ev: dict) -> list[float]:
    return [row["correct"] / row["n"] for row in ev["per_problem"]]


def mean_se(x: list[float]) -> tuple[float, float]:
    return statistics.fmean(x), statistics.stdev(x) / math.sqrt(len(x))


def distances(base: str, runs: dict[str, Path]) -> dict:
    from deltalens.io.tensors import open_tensors

    opened = {d: open_tensors(str(r)) for d, r in runs.items()}
    with open_tensors(base) as b:
        sums = {"base": 0.0, **{d: 0.0 for d in runs}, "dot": 0.0, "gap": 0.0}
        for name in b.names():
            t0 = b.get(name).double()
            delta = {d: src.get(name).double() - t0 for d, src in opened.items()}
            sums["base"] += float(t0.square().sum())
            for d in runs:
                sums[d] += float(delta[d].square().sum())
            sums["dot"] += float((delta["fp32"] * delta["bf16"]).sum())
            sums["gap"] += float((delta["bf16"] - delta["fp32"]).square().sum())
    for src in opened.values():
        src.close()
    l2 = {d: math.sqrt(sums[d]) for d in runs}
    return {"l2": l2, "rel_l2": {d: l2[d] / math.sqrt(sums["base"]) for d in runs},
            "l2_ratio_bf16_over_fp32": l2["bf16"] / l2["fp32"],
            "cosine": sums["dot"] / (l2["fp32"] * l2["bf16"]),
            "gap_over_fp32_l2": math.sqrt(sums["gap"]) / l2["fp32"]}


def run_facts(run: Path) -> dict:
    secs = (run / "state.json").stat().st_mtime - (run / "config.json").stat().st_mtime
    rewards = []
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if "reward_mean" in row:
                rewards.append(round(row["reward_mean"], 4))
    return {"train_seconds": round(secs), "reward_mean_per_iteration": rewards}


def finish(res: dict, evs: dict, t0: float, out: str | None) -> None:
    """Add every evaluation's per-problem correct counts and the wall time; print the JSON, write it to `out`."""
    res["per_problem_correct"] = {k: [row["correct"] for row in ev["per_problem"]] for k, ev in evs.items()}
    res["wall_s"] = round(time.time() - t0)
    text = json.dumps(res, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--limit", type=int, default=100, help="validation problems")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--dir", default="build/es-dtype")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    runs = {d: root / d for d in DTYPES}
    for d, run in runs.items():
        train(args.model, run, d, args.iterations)
    evs = {"base": evaluate(args.model, root / "eval-base.json", args.limit, args.samples)}
    for d, run in runs.items():
        evs[d] = evaluate(str(run), root / f"eval-{d}.json", args.limit, args.samples)
    per = {k: rates(ev) for k, ev in evs.items()}
    res = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "iterations": args.iterations,
           "validation_problems": args.limit, "samples": args.samples, "temperature": 0.6,
           "eval_compute_dtype": "auto", "cpu_count": os.cpu_count(), "pass_at_1": {}}
    for k, x in per.items():
        m, se = mean_se(x)
        res["pass_at_1"][k] = {"mean": round(m, 4), "se": round(se, 4)}
        if k != "base":
            dm, dse = mean_se([a - b for a, b in zip(x, per["base"])])
            res["pass_at_1"][k]["minus_base"] = {"mean": round(dm, 4), "paired_se": round(dse, 4)}
    dm, dse = mean_se([b - a for a, b in zip(per["fp32"], per["bf16"])])
    res["bf16_minus_fp32"] = {"mean": round(dm, 4), "paired_se": round(dse, 4), "within_2se": abs(dm) <= 2 * dse}
    res["distance"] = distances(args.model, runs)
    res["runs"] = {d: run_facts(run) for d, run in runs.items()}
    finish(res, evs, t0, args.out)


if __name__ == "__main__":
    main()
