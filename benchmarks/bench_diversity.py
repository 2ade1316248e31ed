"""The small-σ law of population diversity, measured: JS ≈ (σ²/2)(1 − 1/N) tr I_x(θ) (Lemma 1 of arXiv
2608.27351) as σ varies over a decade or more, same noise ε scaled.

    OMP_NUM_THREADS=1 python benchmarks/bench_diversity.py                      # tiny, ~1.5 min on 1 core
    OMP_NUM_THREADS=1 python benchmarks/bench_diversity.py --sigmas 3e-4,1e-3 --draws 4   # E over ε, ~4 min
    python benchmarks/bench_diversity.py --model runs/es/checkpoints/final --sigmas 1e-4,1e-3 --members 16

Prints one JSON document: the settings, tr I_x (mean over prompts ± se, from per-sample backward passes
at the centre), and per σ: js_measured ± se (the direct estimator), js_mi ± se (posterior-entropy
estimator, the one analysis.json and the report show; same log-prob table), js_pred (the law with E over ε), js_pred_draw (the law on the ε
actually drawn), ratio = js / js_pred, and seconds. Ratios flat in σ show the σ² scaling; their level
shows the coefficient. Because ||∇ log π(y)||² is heavy-tailed (rare responses carry much of tr I),
independent estimates of JS and tr I scatter more than their standard errors say; the paired ratios
(`ratio_paired`: importance-sampled JS on the Fisher's own samples over the law on those samples;
`ratio_paired_draw`: the same against the law on the drawn ε) remove that and should read ≈ 1 at
small σ. At large σ the ratios fall as JS saturates (JS ≤ log N).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--sigmas", default="3e-4,1e-3,3e-3,1e-2")
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--fisher-samples", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draws", type=int, default=1,
                    help="repeat with noise seeds seed..seed+draws-1: the law is an expectation over ε")
    args = ap.parse_args(argv)

    import torch

    from deltalens.analysis.diversity import sigma_sweep
    from deltalens.io.models import load_model
    from deltalens.tasks import get_task
    from deltalens.training.es.config import ESConfig

    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    sigmas = [float(s) for s in args.sigmas.split(",")]
    draws = []
    for d in range(args.draws):  # same prompts and sampling seed, a different noise seed per draw
        draws.append(sigma_sweep(model, tok, get_task(args.task), sigmas, prompts=args.prompts,
                                 config=ESConfig(seed=args.seed + d, population=args.members),
                                 samples=args.samples, temperature=args.temperature, seed=args.seed,
                                 fisher_samples=args.fisher_samples))
    rows = draws[0]
    first = rows[0]
    out = {
        "model": args.model, "task": args.task, "members": args.members, "prompts": args.prompts,
        "samples": args.samples, "fisher_samples": args.fisher_samples, "temperature": args.temperature,
        "torch_threads": torch.get_num_threads(),
        "fisher_trace": round(first["fisher_trace"], 1), "fisher_trace_se": round(first["fisher_trace_se"], 1),
        "sweep": [{
            "sigma": r["sigma"],
            "js_measured": f"{r['js_direct_mean']:.4g} ± {r['js_direct_se']:.2g}",
            "js_mi": f"{r['js_mi_mean']:.4g} ± {r['js_mi_se']:.2g}",
            "js_pred": f"{r['js_pred']:.4g} ± {r['js_pred_se']:.2g}",
            "js_pred_draw": None if r["js_pred_draw"] is None else float(f"{r['js_pred_draw']:.4g}"),
            "ratio": round(r["ratio_direct"], 3), "ratio_mi": round(r["ratio_mi"], 3),
            "ratio_mi_draw": None if not r["js_pred_draw"] else round(r["js_mi_mean"] / r["js_pred_draw"], 3),
            "js_is": f"{r['js_is']:.4g} ± {r['js_is_se']:.2g}",
            "ratio_paired": f"{r['ratio_paired']:.3f} ± {r['ratio_paired_se']:.2g}",
            "ratio_paired_draw": None if r["ratio_paired_draw"] is None else
            f"{r['ratio_paired_draw']:.3f} ± {r['ratio_paired_draw_se']:.2g}",
            "seconds": round(r["timing"]["sample_s"] + r["timing"]["score_s"], 1),
        } for r in rows],
        "total_s": round(time.perf_counter() - t0, 1),
    }
    if args.draws > 1:  # mean over draws of the member-sampled JS (posterior estimator) / the law
        out["over_draws"] = [{
            "sigma": s,
            "draw_factor": [round(d[k]["js_pred_draw"] / d[k]["js_pred"], 3) for d in draws],
            "ratio_mi": [round(d[k]["ratio_mi"], 3) for d in draws],
            "ratio_mi_mean": round(sum(d[k]["js_mi_mean"] for d in draws) / sum(d[k]["js_pred"] for d in draws), 3),
            "ratio_paired_mean": round(sum(d[k]["js_is"] for d in draws) / sum(d[k]["js_pred"] for d in draws), 3),
        } for k, s in enumerate(sigmas)]  # tr I is shared: the Fisher samples do not depend on the noise
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
