"""Claim 3: most of ES's Pass@1 gain survives a global magnitude threshold up to ~90% sparsity of Δ.

    python examples/03_sparsify.py --seeds 0 --methods es,grpo     # reuses the runs of example 01
    python examples/03_sparsify.py --quick --seeds 0               # seconds (tests)

For each run: reset to the base every changed coordinate with |Δ| <= τ, where τ is the exact global
threshold that zeroes a target fraction of the changed coordinates (deltalens.sparsify.thresholds_for_sparsity),
then re-evaluate Pass@K on the same test problems; gain retained = (p - p_base) / (p_full - p_base)
(undefined when the full run has no gain). Default targets 0.5, 0.8, 0.9, 0.95, 0.99.
Cost: one evaluation per (run, target): ~20-40 s each at 100 problems x 32 samples on 2 shared cores.
Writes <out>/03_sparsify.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


def main(argv=None) -> dict:
    from deltalens.analysis.sparsify import sparsify_sweep
    from deltalens.evaluation import evaluate_state_dict
    from deltalens.io.spec import resolve

    ap = C.parser(__doc__, seeds="0")
    ap.add_argument("--methods", default="es,grpo")
    ap.add_argument("--targets", default="0.5,0.8,0.9,0.95,0.99")
    ap.add_argument("--task", default="arith")
    args = ap.parse_args(argv)
    s = C.settings(args)
    targets = [float(x) for x in args.targets.split(",")] if not args.quick else [0.5, 0.9]
    base = str(resolve(args.model).location)
    cache: dict = {}
    per, rows = {}, []
    for seed in C.seeds_of(args):
        for m in [x for x in args.methods.split(",") if x]:
            run = C.ensure_run(args.runs, m, seed, s, args.quick, model=args.model)[0]

            def evaluate_fn(sd):
                return evaluate_state_dict(args.model, sd, args.task, samples=s["samples"], ks=s["ks"],
                                           temperature=0.6, limit=s["limit"], seed=0, model_cache=cache)

            sec = C.eval_cached(args.runs, f"sparsify-{run.name}-{args.task}-{s['limit']}-{s['samples']}-"
                                + "_".join(map(str, targets)),
                                lambda run=run, m=m, fn=evaluate_fn: sparsify_sweep(
                                    base, str(resolve(str(run)).location), [], fn, sparsities=targets, label=m,
                                    task=args.task))
            per.setdefault(seed, {})[m] = sec[m]
            ks = [str(k) for k in sec[m]["ks"]]
            rows.append([seed, m, "0 (full)", "1.000"] + [C.fmt(sec[m]["full_pass_at_k"][k]) for k in ks] + ["1.000"])
            for p in sec[m]["points"]:
                rows.append([seed, m, f"{p['sparsity']:.3f}", C.fmt(p["kept_l2_frac"])]
                            + [C.fmt(p["pass_at_k"][k]) for k in ks] + [C.fmt(p["gain_retained"])])
            rows.append([seed, m, "base", "0"] + [C.fmt(sec[m]["base_pass_at_k"][k]) for k in ks] + ["0"])
    md = ("Global-threshold sparsification of Δ with re-evaluation (paper: most Pass@1 gain kept to ~90%)\n\n"
          + C.table(["seed", "method", "sparsity", "kept L2 frac"] + [f"Pass@{k}" for k in ks]
                    + ["Pass@1 gain retained"], rows))
    result = {"settings": s, "targets": targets, "per_seed": per}
    C.save(args.out, "03_sparsify", result, md)
    return result


if __name__ == "__main__":
    main()
