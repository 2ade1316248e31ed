"""Evaluation throughput: deltalens' batched HF backend vs a plain per-prompt `model.generate` loop.

    python benchmarks/bench_eval.py [--model tiny] [--limit 200] [--samples 32] [--baseline-limit 20]

Both run on the same prompts, same sampling settings, side by side in one process; prints JSON with
tokens/s of each and their ratio (goal: batched >= 1x the plain loop), plus the wall time of the full
`deltalens eval tiny --task arith --limit 200 --samples 32` workload (goal: < 30 s on 2 cores).
The plain loop is slow, so it runs on --baseline-limit prompts and is compared per token.
"""

import argparse
import json
import time

import torch

from deltalens.evaluation import evaluate
from deltalens.generation import HFBackend, SamplingParams
from deltalens.io.models import load_model
from deltalens.tasks import get_task


def plain_loop(model, tok, prompts, n, temperature, max_new_tokens):
    """What a user writes first: one generate call per prompt with num_return_sequences=n."""
    new_tokens = 0
    for p in prompts:
        ids = tok(p, return_tensors="pt")
        out = model.generate(**ids, do_sample=True, temperature=temperature, top_k=0, max_new_tokens=max_new_tokens,
                             num_return_sequences=n, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        gen = out[:, ids["input_ids"].shape[1]:]
        new_tokens += int((gen != tok.pad_token_id).sum())
    return new_tokens


def count_tokens(tok, completions):
    return sum(len(tok(c, add_special_tokens=False)["input_ids"]) + 1 for cs in completions for c in cs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--baseline-limit", type=int, default=20)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    task = get_task(args.task)
    prompts = [p.prompt for p in task.test(args.baseline_limit)]
    params = SamplingParams(n=args.samples, temperature=0.6, max_new_tokens=task.max_new_tokens, seed=0)
    with torch.no_grad():
        t0 = time.perf_counter()
        base_tokens = plain_loop(model, tok, prompts, args.samples, 0.6, task.max_new_tokens)
        t_plain = time.perf_counter() - t0
        t0 = time.perf_counter()
        comps = HFBackend(model, tok).generate(prompts, params)
        t_batched = time.perf_counter() - t0
    ours_tokens = count_tokens(tok, comps)
    t0 = time.perf_counter()
    res = evaluate(model, tok, task, samples=args.samples, limit=args.limit)
    t_full = time.perf_counter() - t0
    out = {
        "model": args.model, "threads": torch.get_num_threads(),
        "same_prompts": {"prompts": len(prompts), "samples": args.samples,
                         "plain_loop_tokens_per_s": round(base_tokens / t_plain, 1),
                         "batched_tokens_per_s": round(ours_tokens / t_batched, 1),
                         "speedup": round((ours_tokens / t_batched) / (base_tokens / t_plain), 2)},
        "full_eval": {"problems": args.limit, "samples": args.samples, "wall_s": round(t_full, 2),
                      "pass_at_k": res["pass_at_k"]},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
