"""How far must every parameter of a named model move (x its tensor's std) before its greedy answers change?
The power check of tests/generation/test_vllm_named_models.py (MOVE). HF, fp32, seed 0, its 8 test problems:

    python benchmarks/named_move_scan.py qwen2.5-0.5b 0.05,0.1,0.2,0.3

Output of 2026-12-04: results/named-move-scan-and-probe-times-2026-12-04.json."""

import sys
import time

import torch

from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation.prompts import problem_prompts
from deltalens.io.models import apply_state_dict, load_model
from deltalens.tasks import get_task

if len(sys.argv) != 3:
    sys.exit("usage: python benchmarks/named_move_scan.py MODEL SCALE[,SCALE...]")
name = sys.argv[1]; scales = [float(s) for s in sys.argv[2].split(",")]
task = get_task("add:digits=1-2,terms=2,shots=2"); problems = task.test(8)
model, tok = load_model(name); hf = HFBackend(model, tok)
greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=task.max_new_tokens)
prompts = problem_prompts(problems, hf.chat)
base = {n: p.detach().clone() for n, p in model.named_parameters()}
want = hf.generate(prompts, greedy)
print("base right", sum(task.verify(c[0], p.answer) for c, p in zip(want, problems)), flush=True)
for s in scales:
    g = torch.Generator().manual_seed(0)
    noisy = {n: p + s * p.std() * torch.randn(p.shape, generator=g) for n, p in base.items()}
    apply_state_dict(model, noisy); t = time.time()
    got = hf.generate(prompts, greedy)
    print(s, "changed", sum(a != b for a, b in zip(want, got)), "right", sum(task.verify(c[0], p.answer) for c, p in zip(got, problems)), f"{time.time()-t:.0f}s", [c[0][:30] for c in got][:3], flush=True)
