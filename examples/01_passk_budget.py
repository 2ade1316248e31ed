"""Claim 1: Pass@1/16/32 of base, ES, GRPO, ES->GRPO and GRPO->ES at FLOP-matched budgets (N = 4G).

    python examples/01_passk_budget.py --seeds 0,1,2            # tiny, budget 10240 units per method
    python examples/01_passk_budget.py --quick --seeds 0         # seconds (tests)

Each method gets the same compute (deltalens.training.budget: ES N=32 x P=8 prompts = 512 units/iteration,
GRPO G=8 x P=8 = 512 units/step; default budget 10240 = 20 ES iterations = 20 GRPO steps; the sequences
split it half/half). Every model is evaluated on the same 100 `arith` test problems x 32 samples (T=0.6).
Cost on 2 shared CPU cores: per seed ES ~4 min, GRPO ~35 s, each sequence ~100 s, ~15-20 s per evaluation
(~9 min per seed for all four methods).
Runs are cached in --runs and reused by examples 02-05.
Writes <out>/01_passk_budget_s<seeds>[_<methods>].json: per method, per seed Pass@K, and mean ± std over seeds.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


def main(argv=None) -> dict:
    ap = C.parser(__doc__)
    ap.add_argument("--methods", default=",".join(C.METHODS), help="subset of es,grpo,es-grpo,grpo-es")
    ap.add_argument("--task", default="arith")
    args = ap.parse_args(argv)
    s = C.settings(args)
    methods = [m for m in args.methods.split(",") if m]
    per: dict = {"base": {}}
    wall: dict = {}
    base_pk = C.eval_cached(args.runs, f"base-{args.model.replace('/', '_')}-{args.task}-{s['limit']}-{s['samples']}",
                            lambda: C.evaluate_spec(args.model, args.task, s))
    for seed in C.seeds_of(args):
        per["base"][seed] = base_pk
        for m in methods:
            run, secs = C.ensure_run(args.runs, m, seed, s, args.quick, model=args.model)
            wall.setdefault(m, 0.0)
            wall[m] += secs
            per.setdefault(m, {})[seed] = C.eval_cached(
                args.runs, f"{run.name}-{args.task}-{s['limit']}-{s['samples']}",
                lambda run=run: C.evaluate_spec(run, args.task, s))
    ks = [str(k) for k in s["ks"]]
    summary = {}
    rows = []
    for m, by_seed in per.items():
        summary[m] = {}
        row = [m]
        for k in ks:
            mu, sd = C.mean_std([r["pass_at_k"].get(k) for r in by_seed.values()])
            summary[m][k] = {"mean": mu, "std": sd}
            row.append(C.fmt(mu, sd))
        rows.append(row)
    md = (f"Pass@K on {args.task} ({s['limit']} problems x {s['samples']} samples, T=0.6), budget "
          f"{s['budget']:g} units per method, N={s['N']}, G={s['G']}, seeds {C.seeds_of(args)} (mean ± std)\n\n"
          + C.table(["method"] + [f"Pass@{k}" for k in ks], rows))
    result = {"settings": s, "seeds": C.seeds_of(args), "per_seed": per, "summary": summary,
              "train_wall_s": wall, "runs": str(args.runs)}
    C.save(args.out, "01_passk_budget_s" + "-".join(map(str, C.seeds_of(args))) + ("" if methods == list(C.METHODS) else "_" + "-".join(methods)), result, md)
    return result


if __name__ == "__main__":
    main()
