"""Claim 4: where the largest updates sit: group composition of the top-100 coordinates by |Δ| and by |Δ|/|θ0|.

    python examples/04_topk_groups.py --seeds 0,1,2      # reuses the runs of example 01
    python examples/04_topk_groups.py --quick --seeds 0   # seconds (tests)

The paper reports that ES's largest changes concentrate in normalization weights. For ES and GRPO
(and the sequences), the count of top-100 coordinates per parameter group (embed, attn_*, mlp_*, norm,
lm_head), under the absolute ranking and the relative one, summed over seeds. Also each group's share of
all parameters (what a uniform spread would give). Cost: seconds once the runs exist.
Writes <out>/04_topk_groups_s<seeds>_<methods>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


def composition_rows(diff: dict, label: str) -> dict:
    n = diff["n_params"]
    return {"abs": diff["topk"]["abs"]["composition"], "rel": diff["topk"]["rel"]["composition"],
            "param_share": {g: v["n"] / n for g, v in diff["groups"].items()},
            "frac_changed": diff["whole"]["frac_changed"], "k": diff["topk"]["k"]}


def render(comps: dict[str, dict]) -> str:
    groups = sorted({g for c in comps.values() for r in ("abs", "rel") for g in c[r]}
                    | {g for c in comps.values() for g in c["param_share"]})
    share = next(iter(comps.values()))["param_share"]
    rows = []
    for g in groups:
        row = [g, f"{100 * share.get(g, 0):.1f}%"]
        for c in comps.values():
            row += [c["abs"].get(g, 0), c["rel"].get(g, 0)]
        rows.append(row)
    header = ["group", "share of params"] + [f"{lab} {r}" for lab in comps for r in ("|Δ|", "|Δ|/|θ0|")]
    return C.table(header, rows)


def main(argv=None) -> dict:
    from deltalens.analysis.delta import diff_checkpoints
    from deltalens.io.spec import resolve

    ap = C.parser(__doc__)
    ap.add_argument("--methods", default="es,grpo,es-grpo,grpo-es")
    args = ap.parse_args(argv)
    s = C.settings(args)
    methods = [m for m in args.methods.split(",") if m]
    base = resolve(args.model).location
    per, total = {}, {}
    for seed in C.seeds_of(args):
        runs = [C.ensure_run(args.runs, m, seed, s, args.quick, model=args.model)[0] for m in methods]
        d = diff_checkpoints(base, [resolve(str(r)).location for r in runs], methods, progress=False)["diff"]
        per[seed] = {m: composition_rows(d[m], m) for m in methods}
        for m in methods:
            t = total.setdefault(m, {"abs": {}, "rel": {}, "param_share": per[seed][m]["param_share"]})
            for r in ("abs", "rel"):
                for g, c in per[seed][m][r].items():
                    t[r][g] = t[r].get(g, 0) + c
    md = (f"Top-{100} coordinates per group, summed over seeds {C.seeds_of(args)} "
          f"({len(C.seeds_of(args))} x 100 coordinates per column)\n\n" + render(total))
    result = {"settings": s, "per_seed": per, "summed": total}
    C.save(args.out, "04_topk_groups_s" + "-".join(map(str, C.seeds_of(args))) + "_" + "-".join(methods), result, md)
    return result


if __name__ == "__main__":
    main()
