"""Did a training run raise validation Pass@1 over its base? Sampled Pass@1 of both on the same validation
problems, with the paired standard error over problems (issue #33's "ES and GRPO each raise validation
Pass@1 on Qwen2.5-0.5B (one seed, the presets' intervals)").

    python benchmarks/validation_gain.py RUN_DIR [--checkpoint NAME] [--limit 100] [--samples 8] [--dir DIR] [--out FILE]

Evaluates the run's base model (its config.json's `model`) and its final weights (or, with --checkpoint, the
run's checkpoints/NAME: a run stopped early) with `deltalens eval --task TASK --split validation --limit L
--samples S --k 1 --temperature 0.6 --seed 0 --compute-dtype auto`, TASK the run's own (one and the same
evaluation for both, so only the weights differ; each eval JSON is kept in DIR and reused), then reports

- Pass@1 of each with its SE over problems, and final minus base with the paired SE (the same problems and
  sampling seed) and a 95% normal interval: "raised" when its lower end is above 0;
- the run's own greedy validation curve (metrics.jsonl `eval.pass_at_1`, the first `eval_limit` problems)
  and its training seconds and per-iteration mean rewards;
- coverage: Pass@S of each (the share of problems solved at least once in S samples), and the problems lost
  (base >= S/4 correct, trained <= 1) and gained (the reverse): issue #34's "problems lost", per run;
- the machine the evaluations ran on (their `timing.machine`);
- the per-problem correct counts of both, so every number can be re-derived.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from es_compute_dtype_agreement import evaluate, finish, mean_se, rates, run_facts

from deltalens.analysis.stats import LOST_METHOD_AT_MOST, problems_lost


def greedy_curve(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if isinstance(row.get("eval"), dict) and "pass_at_1" in row["eval"]:
            out[row["iteration"]] = row["eval"]["pass_at_1"]
    return out


def coverage(base: dict, final: dict, samples: int) -> dict:
    """Pass@S of both and the problems lost / gained between them (module doc): the study's count
    (`stats.problems_lost`) with the bar at S/4 correct, and with the roles swapped for the gained ones."""
    b = [row["correct"] for row in base["per_problem"]]
    f = [row["correct"] for row in final["per_problem"]]
    high = math.ceil(samples / 4)

    def dropped(frm: list[int], to: list[int]) -> int:
        (n,) = problems_lost([[c / samples for c in frm]], [to], base_at_least=high / samples)["per_seed"]
        return n

    return {"pass_at_s": {"base": sum(x > 0 for x in b) / len(b), "final": sum(y > 0 for y in f) / len(f)},
            "lost": dropped(b, f), "gained": dropped(f, b),
            "rule": f"lost: base >= {high}/{samples} correct and trained <= {LOST_METHOD_AT_MOST}/{samples}; "
                    "gained: the reverse"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a finished deltalens run directory")
    ap.add_argument("--checkpoint", default=None, help="evaluate RUN/checkpoints/NAME instead of the final weights")
    ap.add_argument("--limit", type=int, default=100, help="validation problems")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--dir", type=Path, default=None, help="where the eval JSONs go (default: RUN/validation-gain)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    config = json.loads((args.run / "config.json").read_text())
    root = args.dir or args.run / "validation-gain"
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tag = f"{args.limit}x{args.samples}"
    weights, name = (args.run, "final") if args.checkpoint is None else \
        (args.run / "checkpoints" / args.checkpoint, args.checkpoint)
    if not weights.is_dir():
        sys.exit(f"error: {weights} is not a directory")
    task = config.get("task")
    evs = {"base": evaluate(config["model"], root / f"eval-base-{tag}.json", args.limit, args.samples, task),
           "final": evaluate(str(weights), root / f"eval-{name}-{tag}.json", args.limit, args.samples, task)}
    per = {k: rates(ev) for k, ev in evs.items()}
    res = {"date": time.strftime("%Y-%m-%d"), "run": str(args.run), "method": config.get("method"),
           "model": config["model"], "task": task, "validation_problems": args.limit,
           "samples": args.samples, "temperature": 0.6, "eval_compute_dtype": "auto", "pass_at_1": {}}
    for k, x in per.items():
        m, se = mean_se(x)
        res["pass_at_1"][k] = {"mean": round(m, 4), "se": round(se, 4)}
    dm, dse = mean_se([a - b for a, b in zip(per["final"], per["base"])])
    res["final_minus_base"] = {"mean": round(dm, 4), "paired_se": round(dse, 4),
                               "ci95": [round(dm - 1.96 * dse, 4), round(dm + 1.96 * dse, 4)],
                               "raised": dm - 1.96 * dse > 0}
    res["weights"] = "final" if args.checkpoint is None else f"checkpoints/{args.checkpoint}"
    res["coverage"] = coverage(evs["base"], evs["final"], args.samples)
    res["machine"] = sorted({ev.get("timing", {}).get("machine", "not recorded") for ev in evs.values()})
    res["greedy_validation_curve"] = greedy_curve(args.run)
    res["run_facts"] = run_facts(args.run)
    finish(res, evs, t0, args.out)


if __name__ == "__main__":
    main()
