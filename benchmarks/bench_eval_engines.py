"""The evaluation `deltalens eval` runs, through every engine we have, side by side in one process.

    python benchmarks/bench_eval_engines.py [--model smollm2] [--limit 50] [--samples 32] [--temperature 0.6]
        [--engines hf_fp32_copies,hf_fp32,hf_bf16_copies,hf_bf16_generate,hf_bf16,vllm_fp32,vllm_bf16] [--out F]

One workload: the model's default task, the first --limit test problems x --samples samples at
--temperature, the task's max_new_tokens and stop strings, seed 0, scored as `deltalens.evaluation.evaluate`
scores it. Engines, in this order (the HF ones first: a vLLM engine binds the process to its cores,
and HF measured after one is not a stable figure, benchmarks/README.md):
- hf_fp32_copies, hf_bf16_copies: `HFBackend(share_prompts=False)`, each row holding a copy of its prompt's
  KV cache, each segment decoded by transformers' `generate` (the HF backend as it was before 2026-12-06;
  fp32 is "today's HF fp32" of issue #32);
- hf_bf16_generate: the prompt's cache shared, each segment still through `generate` (the HF backend from
  2026-12-06 to 2026-12-07, before `deltalens.generation.decode`);
- hf_fp32, hf_bf16: the HF backend as `deltalens eval` runs it now (rows read their prompt's cache once,
  `deltalens.generation.shared_prefix`; our decoding loop, `deltalens.generation.decode`);
- vllm_fp32, vllm_bf16: `VLLMBackend.from_model` on the same weights (only where vllm imports: run this in
  the vLLM venv); engine start is timed apart from generation.
Each engine runs after one warm-up call on 2 problems. Tokens are the completions' token counts (the same
tokenizer for all); tokens/s is over the evaluation's generation seconds (`timing.generate_s`), and each
row keeps Pass@K and the per-problem correct counts, so the engines' agreement can be read from the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import time

import torch
from bench_generation import emit

from deltalens.evaluation import evaluate
from deltalens.generation import HFBackend
from deltalens.generation import decode as decode_mod
from deltalens.generation.dtype import machine
from deltalens.io.models import load_model
from deltalens.presets import default_task
from deltalens.tasks import get_task

ENGINES = ("hf_fp32_copies", "hf_fp32", "hf_bf16_copies", "hf_bf16_generate", "hf_bf16", "vllm_fp32", "vllm_bf16")


def backend(engine: str, model, tok):
    kind, dtype, *rest = engine.split("_")
    if kind == "hf":
        return HFBackend(model, tok, compute_dtype=dtype, share_prompts=rest != ["copies"])
    from deltalens.generation.vllm import VLLMBackend

    return VLLMBackend.from_model(model, tok, dtype=dtype)


@contextlib.contextmanager
def decoded_by(engine: str):
    """Within the block, the HF backend decodes each segment with transformers' `generate` where the engine
    is one of the earlier backends (`_copies`, `_generate`), else with `generation.decode`."""
    if not engine.startswith("hf_") or not engine.endswith(("_copies", "_generate")):
        yield
        return
    real = decode_mod.generate_settings
    decode_mod.generate_settings = lambda model: ["the benchmark's engine: transformers' generate"]
    try:
        yield
    finally:
        decode_mod.generate_settings = real


def run(engine: str, model, tok, task, args) -> dict:
    with decoded_by(engine):
        return _run(engine, model, tok, task, args)


def _run(engine: str, model, tok, task, args) -> dict:
    t0 = time.perf_counter()
    be = backend(engine, model, tok)
    start_s = time.perf_counter() - t0
    kw = {"samples": args.samples, "ks": (1, args.samples), "temperature": args.temperature, "backend": be}
    evaluate(model, tok, task, limit=2, **kw)  # warm-up (and the bf16 copy's allocation)
    got: list = []
    t0 = time.perf_counter()
    res = evaluate(model, tok, task, limit=args.limit, on_samples=lambda p, c: got.append(c), **kw)
    wall = time.perf_counter() - t0
    if hasattr(be, "close"):
        be.close()
    tokens = sum(len(tok(c, add_special_tokens=False)["input_ids"]) for cs in got[0] for c in cs)
    gen_s = res["timing"]["generate_s"]
    return {"engine": engine, "start_s": round(start_s, 2), "wall_s": round(wall, 2), "generate_s": gen_s,
            "tokens": tokens, "tokens_per_s": round(tokens / gen_s, 1), "pass_at_k": res["pass_at_k"],
            "correct": [p["correct"] for p in res["per_problem"]]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--out", default=None, help="write the JSON here as well as printing it")
    args = ap.parse_args()
    engines = args.engines.split(",")
    if unknown := sorted(set(engines) - set(ENGINES)):
        ap.error(f"unknown engines {unknown} (known: {', '.join(ENGINES)})")
    if importlib.util.find_spec("vllm") is None:
        skipped = [e for e in engines if e.startswith("vllm")]
        engines = [e for e in engines if not e.startswith("vllm")]
    else:
        skipped = []
    model, tok = load_model(args.model)
    task = get_task(default_task(args.model))
    rows = []
    for e in engines:
        rows.append(run(e, model, tok, task, args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "correct"}), flush=True)
    ref = next((r for r in rows if r["engine"] == "hf_fp32_copies"), rows[0])
    for r in rows:
        r["tokens_per_s_vs_" + ref["engine"]] = round(r["tokens_per_s"] / ref["tokens_per_s"], 2)
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
           "model": args.model, "task": task.name, "limit": args.limit, "samples": args.samples,
           "temperature": args.temperature, "max_new_tokens": task.max_new_tokens,
           "skipped": {e: "vllm is not importable here" for e in skipped}, "rows": rows}
    emit(out, args.out)


if __name__ == "__main__":
    main()
