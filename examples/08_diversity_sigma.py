"""Claim 8: population diversity (Jensen-Shannon divergence between members) and coverage vs σ.

    python examples/08_diversity_sigma.py --sigmas 1e-3,3e-3,1e-2 --members 8 --prompts 8   # ~5-10 min
    python examples/08_diversity_sigma.py --quick                                          # seconds (tests)

For each σ: an ES population of N members θ + σ ε_i around the base model (fresh noise, seed), each
sampling `samples` responses per test prompt at T=0.6 (deltalens.analysis.diversity.diversity_section):
JS between the members' response distributions (js_mean ± se, the posterior estimator, of log N max), JS of the success
indicator (js_succ), the population's coverage (Pass@N with one sample per member) vs the centre's
Pass@N, and the members' mean success p. The paper argues that a wider population covers more.
Writes <out>/08_diversity_sigma.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C


def main(argv=None) -> dict:
    from deltalens.analysis.diversity import diversity_section
    from deltalens.tasks import get_task

    ap = C.parser(__doc__, seeds="0")
    ap.add_argument("--sigmas", default="1e-3,3e-3,1e-2")
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--per-member", type=int, default=4, help="samples per member and prompt")
    ap.add_argument("--task", default="arith")
    args = ap.parse_args(argv)
    members, prompts, per_member = (2, 1, 2) if args.quick else (args.members, args.prompts, args.per_member)
    sigmas = [float(x) for x in args.sigmas.split(",")]
    if args.quick:
        sigmas = sigmas[:2]
    task = get_task(args.task)
    rows, res = [], []
    for seed in C.seeds_of(args):
        for sigma in sigmas:
            sec = diversity_section(args.model, task, members=members, sigma=sigma, prompts=prompts,
                                    samples=per_member, seed=seed, centre_samples=members * per_member)
            sec.pop("per_prompt", None)
            res.append({"seed": seed, **sec})
            rows.append([seed, f"{sigma:g}", members, C.fmt(sec["js_mean"], digits=4) + f" ± {sec['js_se']:.4f}",
                         f"{sec['js_max']:.3f}", C.fmt(sec["js_succ_mean"], digits=4), C.fmt(sec["p_members_mean"]),
                         C.fmt(sec["p_centre_mean"]), C.fmt(sec["coverage_population"]), C.fmt(sec["coverage_centre"])])
    md = (f"Population diversity vs σ around {args.model} ({prompts} {args.task} test prompts, {per_member} "
          f"samples per member, T=0.6)\n\n"
          + C.table(["seed", "σ", "N", "JS (nats)", "log N", "JS success", "p members", "p centre",
                     "coverage pop (Pass@N)", "coverage centre"], rows))
    result = {"results": res}
    C.save(args.out, "08_diversity_sigma", result, md)
    return result


if __name__ == "__main__":
    main()
