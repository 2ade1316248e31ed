"""ES iteration throughput vs pure batched inference of the centre model, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_es_throughput.py --model tiny
    OMP_NUM_THREADS=1 python benchmarks/bench_es_throughput.py --model smollm2
    python benchmarks/bench_es_throughput.py --model tiny --population 8 --prompts 16 --iterations 2

For one model and one ES setting (N members, P prompts, greedy) it measures, on the same prompts:

- `pure`: generation by the unperturbed centre model with the batch shape the batched paths use
  (the P prompts repeated for G members, N/G plain `generate` calls; G = N gives one batch of N x P):
  the limit; measured before and after the ES paths, the better of the two is the reference;
- `sequential`: ES iterations with members one by one (perturb in place, generate, restore), full noise;
- `sequential_lowrank`: the same loop with low-rank noise materialised in place;
- `batched_full`: `--population-batch G`, stacked full-rank member weights;
- `batched_lowrank`: `--population-batch G`, low-rank noise, never materialised (EGGROLL).

An ES iteration is the whole step (evaluate N members, fitness shaping, update); its throughput is the
response tokens it generated per second of iteration. Tokens are counted the same way on every path
(the tokenizer's length of each decoded completion), so the ratios compare like with like. The first
iteration of each path is a warm-up (buffers, allocator) and is left out when --iterations > 1.
Every path starts from the same centre weights, and every path (the pure limit too) generates in
`--compute-dtype` (default fp32). Prints one JSON document; `ratio_to_pure` is the
tokens/s of a path over the pure limit (the goal for tiny with low-rank noise: >= 0.5).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = {  # per model: small enough for minutes on one CPU thread
    "tiny": {"population": 32, "prompts": 64, "max_new_tokens": None, "sigma": 6e-3, "antithetic": True},
    "smollm2": {"population": 8, "prompts": 8, "max_new_tokens": 32, "sigma": 1.5e-3, "antithetic": True},
}


class CountingTask:
    """Wraps a task: counts the tokens of every completion the engine scores."""

    def __init__(self, task, tok):
        self.task, self.tok, self.tokens = task, tok, 0

    def __getattr__(self, name):
        return getattr(self.task, name)

    def score_problem(self, completion, problem):
        self.tokens += count_tokens(self.tok, [completion])
        return self.task.score_problem(completion, problem)


def count_tokens(tok, completions) -> int:
    return sum(len(tok(c, add_special_tokens=False)["input_ids"]) for c in completions)


def bench(spec: str, population: int, prompts: int, max_new_tokens: int | None, sigma: float, antithetic: bool,
          rank: int, group: int | None, iterations: int, dtype: str, device: str = "cpu",
          compute_dtype: str = "fp32") -> dict:
    import torch

    from deltalens.io.models import load_model
    from deltalens.training.es.backends import LocalBackend
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.engine import ESEngine, es_compute_dtype
    from deltalens.training.es.population import generate_replicated
    from deltalens.training.es.strategy import fitness_shaping, iteration_problems
    from deltalens.training.run import make_task

    model, tok = load_model(spec, dtype=dtype, device=device)
    device = str(next(model.parameters()).device)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    centre = {k: v.detach().clone() for k, v in model.state_dict().items()}
    group = group or population
    base = ESConfig(model=spec, population=population, prompts_per_iteration=prompts, sigma=sigma,
                    antithetic=antithetic, max_new_tokens=max_new_tokens, dtype=dtype, eval_every=0, device=device,
                    compute_dtype=compute_dtype)
    task = make_task(base)
    problems = iteration_problems(task, base, 1)

    def pure() -> dict:
        engine = ESEngine(model, tok, task, base)
        params, texts = engine.sampling_params(), [p.prompt for p in problems]
        runner = engine.compute_model()  # in the ES paths' compute dtype (the master, or its bf16 copy)
        generate_replicated(engine.generator, texts[:1], 1, params, segment=None, model=runner)  # warm-up
        t0 = time.perf_counter()
        tokens = 0
        for start in range(0, population, group):
            out = generate_replicated(engine.generator, texts, min(group, population - start), params,
                                      segment=None, model=runner)  # plain batched generate
            tokens += sum(count_tokens(tok, rows) for rows in out)
        seconds = time.perf_counter() - t0
        return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                "batch_rows": min(group, population) * prompts}

    def es(cfg: ESConfig) -> dict:
        model.load_state_dict(centre)
        counter = CountingTask(task, tok)
        engine = ESEngine(model, tok, counter, cfg)
        backend = LocalBackend(engine)
        rows = []
        for it in range(1, iterations + 1):
            counter.tokens = 0
            t0 = time.perf_counter()
            rewards, timing = backend.evaluate(it, iteration_problems(task, cfg, it))
            z = fitness_shaping(rewards, cfg.fitness)
            if not any(z):  # all members tied: time an update that still uses every member's noise
                z = fitness_shaping([float(i % 3) for i in range(population)])
            upd = engine.update(it, z)
            sync()
            timing.update(update_s=upd["update_s"], iteration_s=time.perf_counter() - t0, tokens=counter.tokens,
                          reward_mean=sum(rewards) / len(rewards))
            rows.append(timing)
        engine.close()
        kept = rows[1:] if len(rows) > 1 else rows
        seconds = sum(r["iteration_s"] for r in kept)
        tokens = sum(r["tokens"] for r in kept)
        return {"iteration_s": round(seconds / len(kept), 3), "tokens_per_iteration": tokens / len(kept),
                "tokens_per_s": round(tokens / seconds, 1),
                "split_s": {k: round(sum(r[k] for r in kept) / len(kept), 3)
                            for k in ("generation_s", "noise_s", "perturb_restore_s", "update_s")},
                "reward_mean": round(sum(r["reward_mean"] for r in kept) / len(kept), 4)}

    paths = {
        "sequential": dataclasses.replace(base),
        "sequential_lowrank": dataclasses.replace(base, noise="lowrank", rank=rank),
        "batched_full": dataclasses.replace(base, population_batch=group),
        "batched_lowrank": dataclasses.replace(base, noise="lowrank", rank=rank, population_batch=group),
    }
    t_start = time.perf_counter()
    before = pure()
    results = {name: es(cfg) for name, cfg in paths.items()}
    model.load_state_dict(centre)
    after = pure()
    limit = max(before["tokens_per_s"], after["tokens_per_s"])  # the best observed: conservative ratios
    for r in results.values():
        r["ratio_to_pure"] = round(r["tokens_per_s"] / limit, 3)
    return {
        "model": spec,
        "parameters": sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values()),
        "dtype": dtype,
        "compute_dtype": es_compute_dtype(base, model),
        "device": device,
        "population": population,
        "prompts": prompts,
        "population_batch": group,
        "rank": rank,
        "sigma": sigma,
        "antithetic": antithetic,
        "max_new_tokens": max_new_tokens or task.max_new_tokens,
        "iterations_timed": max(iterations - 1, 1),
        "torch_threads": torch.get_num_threads(),
        "pure": {"before": before, "after": after, "tokens_per_s": round(limit, 1)},
        "es": results,
        "goal_lowrank_ge_half_of_pure": results["batched_lowrank"]["ratio_to_pure"] >= 0.5,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="comma-separated: tiny, smollm2 (or any model spec)")
    ap.add_argument("--population", type=int, default=None, help="N (default per model, see SETTINGS)")
    ap.add_argument("--prompts", type=int, default=None, help="P prompts per iteration")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--sigma", type=float, default=None)
    ap.add_argument("--rank", type=int, default=1, help="low-rank noise rank r")
    ap.add_argument("--population-batch", type=int, default=None, help="members per batch G (default N)")
    ap.add_argument("--iterations", type=int, default=2, help="ES iterations per path (the first is a warm-up)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (the ES noise is drawn on the CPU)")
    ap.add_argument("--compute-dtype", default="fp32", help="what members (and the pure limit) generate in: "
                    "auto, fp32, bf16 (ESConfig.compute_dtype)")
    args = ap.parse_args(argv)
    out = {"benchmark": "es_throughput", "unit": "response tokens / s", "results": []}
    for spec in args.model.split(","):
        s = {**SETTINGS.get(spec, SETTINGS["smollm2"])}
        for key in ("population", "prompts", "max_new_tokens", "sigma"):
            if getattr(args, key) is not None:
                s[key] = getattr(args, key)
        out["results"].append(bench(spec, s["population"], s["prompts"], s["max_new_tokens"], s["sigma"],
                                    s["antithetic"], args.rank, args.population_batch, args.iterations, args.dtype,
                                    args.device, args.compute_dtype))
        print(f"done {spec}", file=sys.stderr)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
