"""Claim 2: ES moves much farther from initialization than GRPO (paper: rel. L2 ratio ES/GRPO = 40-44x).

    python examples/02_distance.py --seeds 0,1,2        # reuses/trains the FLOP-matched runs of example 01
    python examples/02_distance.py --quick --seeds 0     # seconds (tests)

For each seed: ||θ - θ0|| / ||θ0|| (rel_l2) of the ES and GRPO final checkpoints against the base, per
parameter group too, and the ratio ES/GRPO (deltalens.analysis.delta.diff_checkpoints). Cost: seconds once the runs
exist (training them: see 01). Writes <out>/02_distance.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


def diffs(args, s, seed, methods=("es", "grpo")):
    from deltalens.analysis.delta import diff_checkpoints
    from deltalens.io.spec import resolve

    runs = [C.ensure_run(args.runs, m, seed, s, args.quick, model=args.model)[0] for m in methods]
    base = resolve(args.model).location
    return diff_checkpoints(base, [resolve(str(r)).location for r in runs], list(methods), progress=False)


def main(argv=None) -> dict:
    ap = C.parser(__doc__)
    args = ap.parse_args(argv)
    s = C.settings(args)
    per, rows = {}, []
    for seed in C.seeds_of(args):
        d = diffs(args, s, seed, ("es", "grpo"))["diff"]
        es, gr = d["es"]["whole"]["rel_l2"], d["grpo"]["whole"]["rel_l2"]
        per[seed] = {"es_rel_l2": es, "grpo_rel_l2": gr, "ratio": es / gr if gr else None,
                     "es_frac_changed": d["es"]["whole"]["frac_changed"],
                     "grpo_frac_changed": d["grpo"]["whole"]["frac_changed"],
                     "groups": {m: {g: v["rel_l2"] for g, v in d[m]["groups"].items()} for m in ("es", "grpo")}}
        rows.append([seed, f"{es:.3e}", f"{gr:.3e}", C.fmt(per[seed]["ratio"], digits=1)])
    mu, sd = C.mean_std([p["ratio"] for p in per.values()])
    rows.append(["mean ± std", C.fmt(*C.mean_std([p["es_rel_l2"] for p in per.values()]), digits=5),
                 C.fmt(*C.mean_std([p["grpo_rel_l2"] for p in per.values()]), digits=5), C.fmt(mu, sd, 1)])
    md = (f"Relative L2 distance from init at budget {s['budget']:g} units (paper: ES/GRPO = 40-44x)\n\n"
          + C.table(["seed", "ES rel_l2", "GRPO rel_l2", "ES/GRPO"], rows))
    result = {"settings": s, "per_seed": per, "ratio_mean": mu, "ratio_std": sd}
    C.save(args.out, "02_distance", result, md)
    return result


if __name__ == "__main__":
    main()
