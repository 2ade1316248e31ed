"""Per-iteration time breakdown of ES (in-process backend): generation / noise / perturb+restore / update.

    OMP_NUM_THREADS=1 python benchmarks/bench_es.py                       # tiny and smollm2
    python benchmarks/bench_es.py --models tiny --population 8 --prompts 16 --iterations 2
    python benchmarks/bench_es.py --models smollm2 --preset smollm2 --iterations 1 --compute-dtype fp32,bf16
    python benchmarks/bench_es.py --models smollm2 --preset smollm2 --compute-dtype fp32,bf16 --shared-prefix off,on

Prints one JSON document: per model the mean seconds per iteration of each phase and
`overhead_fraction` = (noise + perturb_restore + update) / iteration, the share of an iteration that
is ES bookkeeping rather than generation (goal: <= 0.10). If all members tie (z = 0), the update is timed with a stand-in z so that
it still regenerates every member's noise. The checksum (blake2b of all weights,
used to verify Ray replicas) is reported separately. Generation grows with --prompts while the
noise cost does not, so the fraction falls as prompts per iteration approach the paper's 64.

`--compute-dtype fp32,bf16` runs each model once per compute dtype, in this order, from the same weights
(`ESConfig.compute_dtype`: members generate on a bf16 cast of the perturbed fp32 master); each result
records the resolved dtype, and `speedup_vs_first` is the first one's iteration time over this one's.
The cast of the perturbed master to the compute dtype is counted in generation_s (once per member; with
population batching once per iteration).
`--shared-prefix off,on` runs each compute dtype without and with a member's common prompt prefix shared
(`ESConfig.shared_prefix`, population batching only): "off" is the generation of before 2026-12-06; an "on"
run right after an "off" one records how many of its members' completions differ from the "off" run's
(`completions_differing_from_off`; the same members, problems and seeds). `rewards`: every iteration's
member rewards.
`--preset` takes the ES settings of a preset (population, prompts, noise, population batching, ...);
--population / --prompts then override it only where given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("generation_s", "noise_s", "perturb_restore_s", "update_s", "update_noise_s", "checksum_s",
          "iteration_s")


def bench(model_spec: str, population: int | None, prompts: int | None, iterations: int,
          max_new_tokens: int | None, dtype: str, compute_dtype: str = "fp32", preset: str | None = None,
          shared_prefix: bool | None = None, task: str | None = None) -> dict:
    import torch

    from deltalens.io.models import load_model
    from deltalens.training.es.backends import LocalBackend
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.engine import ESEngine
    from deltalens.training.es.strategy import fitness_shaping, iteration_problems
    from deltalens.training.run import make_task

    t0 = time.perf_counter()
    model, tok = load_model(model_spec, dtype=dtype)
    load_s = time.perf_counter() - t0
    options = {"population": 4, "prompts_per_iteration": 8} if preset is None else {}  # a preset: its own
    options.update({k: v for k, v in (("population", population), ("prompts_per_iteration", prompts)) if v})
    if max_new_tokens:
        options["max_new_tokens"] = max_new_tokens
    if shared_prefix is not None:
        options["shared_prefix"] = shared_prefix
    from deltalens.presets import default_task

    options["task"] = task or default_task(model_spec)  # as `deltalens train es` resolves it
    cfg = ESConfig.preset(preset or "paper", model=model_spec, iterations=iterations, dtype=dtype,
                          compute_dtype=compute_dtype, eval_every=0, **options)
    if shared_prefix is not None and cfg.population_batch <= 1:
        raise SystemExit("--shared-prefix: population batching only (a preset with it, e.g. --preset smollm2)")
    population = cfg.population
    engine = ESEngine(model, tok, make_task(cfg), cfg)
    backend = LocalBackend(engine)
    rows, forced, seen, all_rewards = [], 0, [], []
    score = engine.mean_reward  # every member's completions, in call order (compared between runs in `main`)
    engine.mean_reward = lambda completions, probs, timing=None: seen.append(list(completions)) or score(
        completions, probs, timing)
    for it in range(1, iterations + 1):
        t0 = time.perf_counter()
        rewards, timing = backend.evaluate(it, iteration_problems(engine.task, cfg, it))
        all_rewards.append([float(r) for r in rewards])
        z = fitness_shaping(rewards, cfg.fitness)
        if not any(z):  # all members tied: a real update would skip every draw; time a full one instead
            z = fitness_shaping([float(i % 3) for i in range(population)])
            forced += 1
        upd = backend.update(it, z)
        timing.update({k: upd[k] for k in ("update_s", "update_noise_s", "checksum_s")})
        timing["iteration_s"] = time.perf_counter() - t0
        rows.append(timing)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in PHASES}
    overhead = mean["noise_s"] + mean["perturb_restore_s"] + mean["update_s"]
    return {
        "model": model_spec,
        "parameters": sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values()),
        "trained_parameters": engine.n_trained,
        "dtype": dtype,
        "compute_dtype": engine.compute_dtype,
        "preset": preset,
        "task": cfg.task,
        "noise": cfg.noise,
        "population_batch": cfg.population_batch,
        "shared_prefix": cfg.shared_prefix if cfg.population_batch > 1 else None,
        "population": population,
        "prompts": cfg.prompts_per_iteration,
        "max_new_tokens": engine.max_new_tokens,
        "iterations": iterations,
        "iterations_with_tied_rewards": forced,
        "torch_threads": torch.get_num_threads(),
        "load_s": round(load_s, 2),
        "mean_s": {k: round(v, 4) for k, v in mean.items()},
        "noise_draws_per_s": round(population * engine.n_trained / max(mean["noise_s"], 1e-9) / 1e6, 1),
        "overhead_fraction": round(overhead / mean["iteration_s"], 4),
        "overhead_with_checksum_fraction": round((overhead + mean["checksum_s"]) / mean["iteration_s"], 4),
        "meets_goal_10pct": overhead / mean["iteration_s"] <= 0.10,
        "rewards": all_rewards,  # per iteration, per member
        "_completions": seen,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated model specs")
    ap.add_argument("--population", type=int, default=None, help="default 4, or the preset's")
    ap.add_argument("--prompts", type=int, default=None, help="default 8, or the preset's")
    ap.add_argument("--preset", default=None, help="ES preset (e.g. smollm2, tiny): its settings")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--task", default=None, help="task spec (default: the model's own, as `deltalens train es` "
                    "picks it: deltalens.presets; before 2026-12-06 this benchmark always ran arith)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--compute-dtype", default="fp32",
                    help="comma-separated compute dtypes (auto, fp32, bf16), each run in turn")
    ap.add_argument("--shared-prefix", default=None,
                    help="comma-separated on/off: population batching with a member's common prompt prefix "
                         "shared (ESConfig.shared_prefix), each run in turn within each compute dtype "
                         "(default: the config's)")
    args = ap.parse_args(argv)
    from deltalens.io.heap import keep_freed_memory

    malloc = "keep" if keep_freed_memory() else "trim"  # as the CLI does (DELTALENS_MALLOC)
    out = {"benchmark": "es_iteration_breakdown", "noise_draws_per_s_unit": "million fp32 normals / s",
           "malloc": malloc, "results": []}
    for spec in args.models.split(","):
        first = None
        shares = [None] if args.shared_prefix is None else [
            {"on": True, "off": False}[v] for v in args.shared_prefix.split(",")]
        for compute in args.compute_dtype.split(","):
            unshared = None
            for shared in shares:
                r = bench(spec, args.population, args.prompts, args.iterations, args.max_new_tokens, args.dtype,
                          compute, args.preset, shared, args.task)
                first = first or r
                r["speedup_vs_first"] = round(first["mean_s"]["iteration_s"] / r["mean_s"]["iteration_s"], 3)
                seen = r.pop("_completions")
                if shared is False:
                    unshared = seen
                elif shared and unshared is not None:  # the same dtype without sharing, just before
                    pairs = [(a, b) for x, y in zip(unshared, seen) for a, b in zip(x, y)]
                    r["completions_differing_from_off"] = f"{sum(a != b for a, b in pairs)} of {len(pairs)}"
                out["results"].append(r)
                print(f"done {spec} ({r['compute_dtype']}, shared prefix {r['shared_prefix']})", file=sys.stderr)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
