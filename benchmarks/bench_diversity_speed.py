"""The diversity pass's sampler and scorer now vs as of 7cd2fc3, side by side in one process on one population.

    python benchmarks/bench_diversity_speed.py [--model smollm2] [--members 8] [--prompts 16] [--out F]

As of 7cd2fc3 (its `deltalens/analysis/diversity/sampling.py` read with `git show`) responses were sampled
with transformers' `generate` (every row prefilled its own prompt) and every (prompt + response) sequence
was scored whole, the softmax taken at every position; now `HFBackend`'s loop samples (a prompt prefilled
once for its samples) and the scorer runs only the responses over each prompt's KV cache. Both run
`population_divergence` on the same fresh population (seed 0, σ 1.5e-3; the study's diversity shape by
default: 8 members, 16 test prompts, 4 samples each, T 0.6, the centre's 32 samples per prompt): the
seconds of its phases (sampling the members, scoring under the members, the centre), in the order given
by --order, then the JS estimates of each (different draws of one distribution: they agree within their
standard errors, not to the digit). Agreement of the scorers: both score the same items (every pair the
new pass's centre sampled) under the centre: the largest |Δ log p|. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from unittest import mock

from bench_generation import emit, module_at

REV = "7cd2fc3"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--task", default="add:digits=1-2,terms=3,shots=2")
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--order", default="now,old", help="which implementation runs first")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import torch

    from deltalens.analysis.diversity import divergence, load_population
    from deltalens.analysis.diversity import sampling as now
    from deltalens.tasks import get_task

    old = module_at(REV, "deltalens/analysis/diversity/sampling.py")
    task = get_task(args.task)
    problems = task.test(args.prompts)
    t0 = time.perf_counter()
    pop, _ = load_population(args.model, task, members=args.members, sigma=1.5e-3)
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "model": args.model, "task": args.task, "members": args.members, "prompts": args.prompts,
           "samples": args.samples, "temperature": args.temperature, "old": REV,
           "load_s": round(time.perf_counter() - t0, 1), "runs": {}}
    impl = {"now": now, "old": old}
    for name in args.order.split(","):
        mod = impl[name]
        with mock.patch.object(divergence, "sample_responses", mod.sample_responses), \
             mock.patch.object(divergence, "sequence_logprobs", mod.sequence_logprobs):
            t0 = time.perf_counter()
            r = divergence.population_divergence(pop, task, problems, samples=args.samples,
                                                 temperature=args.temperature, seed=0)
            wall = time.perf_counter() - t0
        out["runs"][name] = {"wall_s": round(wall, 1), **r["timing"], "cost": r["cost"],
                             **{k: r[k] for k in ("js_mean", "js_se", "js_direct_mean", "js_direct_se",
                                                  "p_members_mean", "p_centre_mean", "token_entropy")}}
        print(json.dumps({name: out["runs"][name]}), file=sys.stderr)
    if {"now", "old"} <= out["runs"].keys():
        a, b = out["runs"]["old"], out["runs"]["now"]
        out["speedup"] = {k: round(a[k] / b[k], 2) for k in ("wall_s", "sample_s", "score_s", "centre_s") if b[k]}
    # the two scorers on the same items under the centre
    tok = pop.tokenizer
    pids = now.problem_ids(tok, problems)
    resp = now.sample_responses(pop.centre, tok, pids, args.samples, temperature=args.temperature,
                                max_new_tokens=task.max_new_tokens, seed=1)
    items = [(p, y) for p in range(len(problems)) for y in resp[p]]
    t0 = time.perf_counter()
    a = now.sequence_logprobs(pop.centre, pids, items, args.temperature)["logp"]
    t_now = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = old.sequence_logprobs(pop.centre, pids, items, args.temperature)["logp"]
    t_old = time.perf_counter() - t0
    out["scorers"] = {"items": len(items), "max_abs_logp_diff": float((a - b).abs().max()),
                      "mean_abs_logp": float(b.abs().mean()), "now_s": round(t_now, 2), "old_s": round(t_old, 2),
                      "prompt_tokens_mean": sum(map(len, pids)) / len(pids),
                      "response_tokens_mean": sum(len(y) for _, y in items) / len(items)}
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
