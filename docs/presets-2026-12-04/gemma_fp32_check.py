"""Greedy on HF fp32 and on vLLM fp32 (prefix caching on and off) for TASK's first N validation problems of
gemma3-270m: does vLLM serve it as HF does? Run in the vLLM venv (docs/vllm.md; its transformers, 5.19, loads
the GGUF as a model that answers worse than the main venv's 5.25 does: gemma_dtype_check.py):

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python docs/presets-2026-12-04/gemma_fp32_check.py "add:digits=1-2,terms=2,shots=8" 24

Output of 2026-12-04: gemma_fp32_check.txt beside this file (docs/tuning.md). It ran before
`deltalens.io.models.gguf_bos`: 5.19's Gemma tokenizer added no BOS then, which is why HF solved 0 of 24."""

from __future__ import annotations

import json
import sys

from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation.prompts import problem_prompts
from deltalens.generation.vllm import VLLMBackend
from deltalens.io.models import load_model
from deltalens.tasks import get_task


def main():
    task = get_task(sys.argv[1]); n = int(sys.argv[2])
    problems = task.validation(n)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=task.max_new_tokens)
    model, tok = load_model("gemma3-270m")
    hf = HFBackend(model, tok)
    prompts = problem_prompts(problems, hf.chat)
    print("prompt tokens", [len(e) for e in hf.encode(prompts[:3])], flush=True)
    want = hf.generate(prompts, greedy)
    right = lambda comps: sum(task.verify(c[0], p.answer) for c, p in zip(comps, problems))
    print("hf fp32 right", right(want), flush=True)
    del hf, model
    for pc in (True, False):
        v = VLLMBackend.from_spec("gemma3-270m", dtype="fp32", seed=0, max_model_len=2048, enable_prefix_caching=pc)
        got = v.generate(prompts, greedy); v.close()
        print("vllm prefix_caching", pc, "right", right(got), "same as hf", sum(a == b for a, b in zip(want, got)), "of", n, flush=True)
        print("  e.g.", json.dumps([got[0][0][:60], want[0][0][:60]]), flush=True)

if __name__ == '__main__':
    main()
