"""Claim 5: forgetting on held-out tasks (arith-3, arith-long, arith-big) after ES / GRPO / sequences.

    python examples/05_held_out.py --seeds 0,1,2      # reuses the runs of example 01
    python examples/05_held_out.py --quick --seeds 0   # seconds (tests)

Every model trained on `arith` (4 terms in 2..60) is evaluated on tasks it never trained on: arith-3
(3 terms), arith-long (6 terms), arith-big (3-digit numbers). Change vs base per method (mean ± std over
seeds). Cost: one evaluation per (model, task): ~20-40 s each at 100 x 32 on 2 shared cores.
Writes <out>/05_held_out.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


def main(argv=None) -> dict:
    ap = C.parser(__doc__)
    ap.add_argument("--methods", default=",".join(C.METHODS))
    ap.add_argument("--tasks", default="arith-3,arith-long,arith-big")
    args = ap.parse_args(argv)
    s = C.settings(args)
    tasks = [t for t in args.tasks.split(",") if t]
    methods = [m for m in args.methods.split(",") if m]
    kk = str(max(s["ks"]))
    res: dict = {"base": {}}
    for t in tasks:
        res["base"][t] = C.eval_cached(args.runs, f"base-{args.model.replace('/', '_')}-{t}-{s['limit']}-{s['samples']}",
                                       lambda t=t: C.evaluate_spec(args.model, t, s))
    for seed in C.seeds_of(args):
        for m in methods:
            run = C.ensure_run(args.runs, m, seed, s, args.quick, model=args.model)[0]
            for t in tasks:
                res.setdefault(m, {}).setdefault(t, {})[seed] = C.eval_cached(
                    args.runs, f"{run.name}-{t}-{s['limit']}-{s['samples']}",
                    lambda run=run, t=t: C.evaluate_spec(run, t, s))
    rows = []
    for t in tasks:
        b1, bk = res["base"][t]["pass_at_k"]["1"], res["base"][t]["pass_at_k"][kk]
        rows.append([t, "base", C.fmt(b1), C.fmt(bk), "", ""])
        for m in methods:
            p1 = [r["pass_at_k"]["1"] for r in res[m][t].values()]
            pk = [r["pass_at_k"][kk] for r in res[m][t].values()]
            rows.append([t, m, C.fmt(*C.mean_std(p1)), C.fmt(*C.mean_std(pk)),
                         C.fmt(*C.mean_std([x - b1 for x in p1])), C.fmt(*C.mean_std([x - bk for x in pk]))])
    md = (f"Held-out tasks ({s['limit']} problems x {s['samples']} samples; mean ± std over seeds {C.seeds_of(args)})\n\n"
          + C.table(["task", "model", "Pass@1", f"Pass@{kk}", "ΔPass@1 vs base", f"ΔPass@{kk} vs base"], rows))
    result = {"settings": s, "results": res}
    C.save(args.out, "05_held_out", result, md)
    return result


if __name__ == "__main__":
    main()
