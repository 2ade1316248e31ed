"""Issue "Is 'ES changes norm weights most' a bf16 artifact?": ES and GRPO from the same base, in fp32 and bf16.

    python examples/09_precision.py --seeds 0          # 4 runs (fp32 ones are shared with example 01)
    python examples/09_precision.py --quick --seeds 0   # seconds (tests)

Both methods train the bundled tiny model with otherwise identical settings (the FLOP-matched settings of
example 01) in two weight dtypes: fp32, and bf16 (ESConfig.dtype="bf16": bf16 weights, noise and update
in fp32 rounded once per iteration; GRPOConfig.dtype="bf16": bf16 weights + bf16 autocast, TRL's
`bf16=True`, so AdamW updates are rounded to bf16 weights). Each run is diffed against the base *in its
own dtype* (the bf16 runs against the base rounded to bf16, saved once to --runs/base-bf16), so rounding
the base is not counted as an update. Reported per run:
  top-100 composition by group, ranked by |Δ| and by |Δ|/|θ0|
  frac_changed: share of coordinates with Δ != 0 (bf16 drops updates below half a bf16 ulp)
  Pass@1 and Pass@32 (evaluated in fp32 from the saved weights; 100 test problems x 32 samples)
Cost: 2 bf16 runs (~5 min each on 2 shared cores) + 4 evaluations. Writes <out>/09_precision.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


def base_in(dtype: str, runs: Path, model: str) -> Path:
    from deltalens.io.models import load_model
    from deltalens.io.spec import resolve

    if dtype == "fp32":
        return Path(resolve(model).location)
    out = Path(runs) / f"base-{dtype}"
    if not (out / "config.json").exists():
        m, tok = load_model(model, dtype=dtype)
        m.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
    return out


def main(argv=None) -> dict:
    from deltalens.analysis.delta import diff_checkpoints
    from deltalens.io.spec import resolve

    ap = C.parser(__doc__, seeds="0")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--methods", default="es,grpo")
    ap.add_argument("--task", default="arith")
    args = ap.parse_args(argv)
    s = C.settings(args)
    dtypes = [d for d in args.dtypes.split(",") if d]
    methods = [m for m in args.methods.split(",") if m]
    kk = str(max(s["ks"]))
    res, rows = {}, []
    for seed in C.seeds_of(args):
        for dt in dtypes:
            base = base_in(dt, args.runs, args.model)
            for m in methods:
                run, secs = C.ensure_run(args.runs, m, seed, s, args.quick, model=args.model, dtype=dt)
                d = diff_checkpoints(base, [resolve(str(run)).location], [m], progress=False)["diff"][m]
                ev = C.eval_cached(args.runs, f"{run.name}-{args.task}-{s['limit']}-{s['samples']}",
                                   lambda run=run: C.evaluate_spec(run, args.task, s))
                r = {"seed": seed, "dtype": dt, "method": m, "run": str(run), "train_s": secs,
                     "top_abs": d["topk"]["abs"]["composition"], "top_rel": d["topk"]["rel"]["composition"],
                     "frac_changed": d["whole"]["frac_changed"], "rel_l2": d["whole"]["rel_l2"],
                     "group_frac_changed": {g: v["frac_changed"] for g, v in d["groups"].items()},
                     "group_rel_l2": {g: v["rel_l2"] for g, v in d["groups"].items()},
                     "pass_at_k": ev["pass_at_k"], "warnings": d["warnings"]}
                res.setdefault(seed, []).append(r)

                def comp(c):
                    return ", ".join(f"{g} {n}" for g, n in sorted(c.items(), key=lambda x: -x[1]))

                rows.append([seed, m, dt, comp(r["top_abs"]), comp(r["top_rel"]), f"{r['frac_changed']:.4f}",
                             f"{r['group_frac_changed'].get('norm', float('nan')):.4f}", f"{r['rel_l2']:.2e}",
                             C.fmt(ev["pass_at_k"]["1"]), C.fmt(ev["pass_at_k"][kk])])
    md = ("ES vs GRPO in fp32 and bf16 (same base, same settings; Δ against the base in the run's dtype)\n\n"
          + C.table(["seed", "method", "dtype", "top-100 by |Δ|", "top-100 by |Δ|/|θ0|", "frac_changed",
                     "frac_changed (norm)", "rel_l2", "Pass@1", f"Pass@{kk}"], rows))
    result = {"settings": s, "results": res}
    C.save(args.out, "09_precision", result, md)
    return result


if __name__ == "__main__":
    main()
