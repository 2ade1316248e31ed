"""Does "ES changes norm weights most" come from the arithmetic rather than from learning? A reward-free replay.

    python examples/10_arithmetic_replay.py --model smollm2 --iterations 5     # ~16 min on 2 CPU cores (940 s, 2026-12-01)
    python examples/10_arithmetic_replay.py --quick                            # seconds (tests; tiny)

No generation and no reward: every iteration draws the population at the paper's settings (N=32,
σ=1.5e-3, α=2.5e-4), perturbs and restores each member exactly as training would, and applies an update
with *random* fitness z (standard normal, the same z for every arithmetic). Whatever structure the
resulting Δ shows is then a property of the arithmetic alone. Four arithmetics on the same weights:

    ours-fp32, ours-bf16      deltalens (a seed per tensor block, fp32 accumulation, exact restore)
    ref-fp32,  ref-bf16       Qiu et al.'s script (one seed per member for every tensor, noise and update
                              in the weight dtype, restore by subtraction): `ESConfig(arithmetic="reference")`

For each: the group composition of the top-100 coordinates by |Δ| and by |Δ|/|θ0|, the rel. L2 of each
parameter group, and the restore drift (how far the weights are from where they started after all
members of an iteration were perturbed and restored, before the update). Hypothesis under test
(arXiv 2608.27351's "ES's top changes sit in norm weights"): the bf16 restore drift and the correlated
noise, not learning, put the norm weights on top. Writes <out>/10_arithmetic_replay.json.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

ARITHMETICS = {"ours-fp32": ("deltalens", "fp32"), "ours-bf16": ("deltalens", "bf16"),
               "ref-fp32": ("reference", "fp32"), "ref-bf16": ("reference", "bf16")}


def replay(model_spec: str, arithmetic: str, dtype: str, iterations: int, population: int, seed: int) -> dict:
    from deltalens.analysis.delta import diff_checkpoints
    from deltalens.io.models import load_model
    from deltalens.tasks import get_task
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.engine import ESEngine, new_timing

    model, tok = load_model(model_spec, dtype=dtype)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = ESConfig(population=population, sigma=1.5e-3, alpha=2.5e-4, arithmetic=arithmetic, seed=seed,
                   restore="subtract" if arithmetic == "reference" else "copy", dtype=dtype, prompts_per_iteration=1)
    eng = ESEngine(model, tok, get_task("arith"), cfg)
    rng = random.Random(f"replay-fitness/{seed}")
    drift_max, drift_frac = 0.0, 0.0
    for it in range(1, iterations + 1):
        start = {n: p.detach().clone() for _, n, p in eng.params}
        timing = new_timing()
        for m in range(population):
            eng.perturb(it, m, timing)
            eng.restore(it, m, timing)
        changed = [(p.detach().float() - start[n].float()).abs() for _, n, p in eng.params]
        drift_max = max(drift_max, max(float(c.max()) for c in changed))
        drift_frac = max(drift_frac, sum(int((c > 0).sum()) for c in changed) / sum(c.numel() for c in changed))
        z = [rng.gauss(0, 1) for _ in range(population)]
        mean = sum(z) / population
        std = (sum((x - mean) ** 2 for x in z) / population) ** 0.5
        eng.update(it, [(x - mean) / std for x in z])
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    eng.close()
    d = diff_checkpoints({k: v.float() for k, v in base.items()}, [{k: v.float() for k, v in final.items()}],
                         ["replay"], progress=False)["diff"]["replay"]
    del model, base, final
    return {"arithmetic": arithmetic, "dtype": dtype, "iterations": iterations, "population": population,
            "restore_drift_max": drift_max, "restore_drift_frac": drift_frac,
            "top_abs": d["topk"]["abs"]["composition"], "top_rel": d["topk"]["rel"]["composition"],
            "rel_l2": {g: m["rel_l2"] for g, m in d["groups"].items()}, "whole_rel_l2": d["whole"]["rel_l2"]}


def main(argv=None) -> dict:
    ap = C.parser(__doc__, seeds="0")
    ap.add_argument("--iterations", type=int, default=None, help="replayed iterations (default 5, quick 1)")
    ap.add_argument("--population", type=int, default=None, help="members per iteration (default 32, quick 4)")
    args = ap.parse_args(argv)
    iterations = args.iterations or (1 if args.quick else 5)
    population = args.population or (4 if args.quick else 32)
    seed = C.seeds_of(args)[0]
    results = {}
    for name, (arithmetic, dtype) in ARITHMETICS.items():
        print(f"{name}: {iterations} iterations x {population} members", flush=True)
        results[name] = replay(args.model, arithmetic, dtype, iterations, population, seed)
    groups = sorted({g for r in results.values() for g in (*r["top_abs"], *r["top_rel"])})
    rows = [[name, f"{r['restore_drift_max']:.2e}", f"{r['restore_drift_frac']:.2f}",
             *[str(r["top_abs"].get(g, 0)) for g in groups], *[str(r["top_rel"].get(g, 0)) for g in groups]]
            for name, r in results.items()]
    header = ["arithmetic", "restore drift max", "share drifted", *[f"|Δ| {g}" for g in groups],
              *[f"|Δ|/|θ0| {g}" for g in groups]]
    md = "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
                   + ["| " + " | ".join(r) + " |" for r in rows])
    result = {"model": args.model, "iterations": iterations, "population": population, "seed": seed,
              "results": results}
    C.save(args.out, "10_arithmetic_replay", result, md)
    return result


if __name__ == "__main__":
    main()
