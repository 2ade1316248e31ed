"""Stop strings on Gemma-3-270M (a base model on plain few-shot prompts), side by side in one process:

    python docs/presets-2026-12-06/gemma_stop_check.py TASK LIMIT SAMPLES OUT.json

1. greedy completions of the first LIMIT validation problems with and without the task's stop string, in
   bf16 and fp32 compute: how many differ once the full ones are cut at the stop string, and the scores;
2. LIMIT x SAMPLES sampled completions at T = 0.6 (bf16, as `auto` resolves here) with and without it:
   seconds, completion tokens generated per sequence, and Pass@1 of each.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from deltalens.evaluation.passk import summarize
from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation.params import cut_at_stop
from deltalens.generation.prompts import problem_prompts
from deltalens.io.models import load_model
from deltalens.tasks import get_task


def main(spec: str, limit: int, samples: int, out: str) -> None:
    task = get_task(spec)
    model, tok = load_model("gemma3-270m")
    problems = task.validation(limit)
    doc = {"model": "gemma3-270m", "task": task.spec, "split": "validation", "limit": limit,
           "torch_threads": torch.get_num_threads(), "greedy": {}, "sampled": {}}
    for dtype in ("bf16", "fp32"):
        be = HFBackend(model, tok, compute_dtype=dtype)
        prompts, stop = problem_prompts(problems, be.chat), task.stop_strings(be.chat)
        full = [c[0] for c in be.generate(prompts, SamplingParams(n=1, temperature=0, max_new_tokens=task.max_new_tokens))]
        cut = [c[0] for c in be.generate(prompts, SamplingParams(n=1, temperature=0, max_new_tokens=task.max_new_tokens,
                                                                 stop=stop))]
        doc["greedy"][dtype] = {
            "stop": list(stop),
            "differ_after_cut": sum(cut_at_stop(f, stop)[0] != c for f, c in zip(full, cut)),
            "correct_without_stop": sum(task.verify(f, p.answer) for f, p in zip(full, problems)),
            "correct_with_stop": sum(task.verify(c, p.answer) for c, p in zip(cut, problems)),
            "full_holds_stop": sum(cut_at_stop(f, stop)[1] for f in full)}
        print(dtype, doc["greedy"][dtype], flush=True)
    be = HFBackend(model, tok, compute_dtype="bf16")
    prompts, stop = problem_prompts(problems, be.chat), task.stop_strings(be.chat)
    for label, s in (("with_stop", stop), ("without_stop", ())):
        params = SamplingParams(n=samples, temperature=0.6, max_new_tokens=task.max_new_tokens, seed=0, stop=s)
        t0 = time.perf_counter()
        comps = be.generate(prompts, params)
        seconds = time.perf_counter() - t0
        tokens = sum(len(tok(c, add_special_tokens=False).input_ids) for cs in comps for c in cs)
        cut = [[cut_at_stop(c, stop)[0] for c in cs] for cs in comps]  # scored as evaluation scores them
        summ = summarize(task, problems, cut, [1, samples], seed=0)
        doc["sampled"][label] = {"seconds": round(seconds, 1), "sequences": limit * samples,
                                 "returned_tokens_per_sequence": round(tokens / (limit * samples), 1),
                                 "pass_at_k": summ["pass_at_k"]}
        print(label, doc["sampled"][label], flush=True)
    doc["sampled"]["speedup"] = round(doc["sampled"]["without_stop"]["seconds"] / doc["sampled"]["with_stop"]["seconds"], 2)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("speedup", doc["sampled"]["speedup"])


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__.strip().splitlines()[2].strip())
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
