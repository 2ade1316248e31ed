"""Greedy Pass@1 of gemma3-270m in fp32 and in bf16 compute on 100 validation problems of
add:digits=1-2,terms=2,shots=8 (HF, the main venv). Output of 2026-12-04: gemma_dtype_check.txt beside this file."""

import time

from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation.prompts import problem_prompts
from deltalens.io.models import load_model
from deltalens.tasks import get_task

task = get_task("add:digits=1-2,terms=2,shots=8"); problems = task.validation(100)
model, tok = load_model("gemma3-270m")
greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=task.max_new_tokens)
res = {}
for d in ("fp32", "bf16"):
    hf = HFBackend(model, tok, compute_dtype=d); t = time.time()
    comps = hf.generate(problem_prompts(problems, hf.chat), greedy)
    res[d] = [task.verify(c[0], p.answer) for c, p in zip(comps, problems)]
    print(d, "right", sum(r == 1 for r in res[d]), "of", len(problems), f"{time.time()-t:.0f}s", flush=True)
a = [x == 1 for x in res["fp32"]]; b = [x == 1 for x in res["bf16"]]
print("only fp32", sum(x and not y for x, y in zip(a, b)), "only bf16", sum(y and not x for x, y in zip(a, b)))
