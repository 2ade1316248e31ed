"""HF generation throughput in fp32 vs bf16 compute, beside this CPU's measured matmul peaks, and the
agreement of bf16 with fp32 on tiny.

    python benchmarks/bench_generation.py [--repeat 3] [--threads N] [--layers 6] [--out FILE]
    python benchmarks/bench_generation.py --greedy-only smollm2 [--limit 100] [--threads N] [--out FILE]

1. Peak: a 256x576x1536 matmul (SmolLM2-135M's MLP shape at 256 rows) in fp32 and bf16, best of 3
   timings of 20 calls each; also at 64 and 16 rows, the rows of the decode shapes below.
2. Throughput of `HFBackend.generate` (what `deltalens eval` runs) on `tiny` (hidden 128, 4 layers) and
   on a random char-level Llama of SmolLM2-135M's width (hidden 576, 9 heads, 3 KV heads, intermediate
   1536) with `--layers` layers (default 6, not SmolLM2's 30, to keep runs short; its vocabulary is the
   char tokenizer's 99, not 49,152, so its lm_head is negligible), at two batch shapes:
   eval = 8 prompts x 8 samples (64 rows), T=0.6, 32 new tokens; ES = 16 prompts x 1, greedy, 32 new
   tokens (one member's decoding at --prompts 16, the small-row regime). Variants: fp32, bf16 (the
   compute copy, `compute_dtype="bf16"`; its one cast per call is inside the timing) and fp32 weights
   under `torch.autocast(cpu, bfloat16)`, interleaved repeat by repeat so machine load hits all alike.
   Tokens = generated tokens up to and including EOS. Achieved FLOP/s = 2 x matmul parameters (all
   but the input embedding) x tokens / seconds (decode-only count: prefill and attention are left out),
   and its fraction of the same run's matmul peak in that dtype (the roofline fraction).
3. Agreement on tiny, 100 arith test problems: greedy completions bf16 vs fp32 (how many differ), and
   sampled Pass@1 (8 samples, T=0.6) of each with the paired standard error of the difference over
   problems; `within_2se` says whether |difference| <= 2 SE. Both dtypes sample with the same seed and
   batches (common random numbers), which is what makes the paired SE small.
4. `--greedy-only MODEL`: only the greedy agreement (and the time of each dtype) on MODEL's default task,
   e.g. the real SmolLM2-135M (Q4_1 dequantized to fp32), which `auto` does switch to bf16.

Prints JSON (also written to --out) with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation.dtype import bf16_is_fast, cpu_flags
from deltalens.io.models import load_model
from deltalens.tasks import get_task


def matmul_gflops(m: int, k: int, n: int, dtype, calls: int = 20, best_of: int = 3) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = math.inf
    for _ in range(best_of):
        t0 = time.perf_counter()
        for _ in range(calls):
            a @ b
        best = min(best, (time.perf_counter() - t0) / calls)
    return 2 * m * k * n / best / 1e9


def smollm2_shaped(layers: int):
    """A random-init Llama of SmolLM2-135M's width, char tokenizer (as tests/support.py small_llama)."""
    from transformers import LlamaForCausalLM

    from deltalens.tiny.build import build_config, build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer()
    cfg = build_config(len(tok), hidden=576, layers=layers, heads=9, kv_heads=3, intermediate=1536)
    return LlamaForCausalLM(cfg).eval(), tok


def matmul_params(model) -> int:
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is emb
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2) - (0 if tied else emb.numel())


def tokens_of(tok, completions) -> int:
    return sum(len(tok(c, add_special_tokens=False)["input_ids"]) + 1 for cs in completions for c in cs)


def throughput(models, shapes, repeat: int, peaks: dict) -> list[dict]:
    arith = get_task("arith")
    rows = []
    for name, (model, tok) in models.items():
        n_params = matmul_params(model)
        backends = {"fp32": HFBackend(model, tok, compute_dtype="fp32"),
                    "bf16": HFBackend(model, tok, compute_dtype="bf16"),
                    "autocast": HFBackend(model, tok, compute_dtype="fp32")}
        for shape, (prompts, params) in shapes.items():
            texts = [p.prompt for p in arith.test(prompts)]
            times: dict[str, list[float]] = {v: [] for v in backends}
            toks: dict[str, int] = {}
            for v, be in backends.items():  # warm-up (and the bf16 copy's first allocation)
                with torch.autocast("cpu", torch.bfloat16, enabled=v == "autocast"):
                    be.generate(texts[:2], params)
            for _ in range(repeat):
                for v, be in backends.items():
                    with torch.autocast("cpu", torch.bfloat16, enabled=v == "autocast"):
                        t0 = time.perf_counter()
                        out = be.generate(texts, params)
                        times[v].append(time.perf_counter() - t0)
                    toks[v] = tokens_of(tok, out)
            for v in backends:
                med = statistics.median(times[v])
                flops = 2 * n_params * toks[v] / med
                peak = peaks["bf16" if v != "fp32" else "fp32"]["256x576x1536"]
                rows.append({"model": name, "shape": shape, "rows": prompts * params.n, "variant": v,
                             "tokens": toks[v], "seconds_each": [round(t, 4) for t in times[v]],
                             "median_s": round(med, 4), "tokens_per_s": round(toks[v] / med, 1),
                             "gflops": round(flops / 1e9, 1), "roofline_fraction": round(flops / 1e9 / peak, 3)})
            base = statistics.median(times["fp32"])
            for r in rows[-len(backends):]:
                r["speedup_vs_fp32"] = round(base / r["median_s"], 2)
    return rows


def agreement(spec: str = "tiny", limit: int = 100, samples: int = 8) -> dict:
    from deltalens.generation.prompts import problem_prompts
    from deltalens.presets import default_task

    model, tok = load_model(spec)
    task = get_task(default_task(spec))
    problems = task.test(limit)
    texts = problem_prompts(problems, HFBackend(model, tok).chat)
    out = {"model": spec, "task": task.spec, "problems": len(problems)}
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=task.max_new_tokens)
    g, secs = {}, {}
    for v in ("fp32", "bf16"):
        t0 = time.perf_counter()
        g[v] = HFBackend(model, tok, compute_dtype=v).generate(texts, greedy)
        secs[v] = round(time.perf_counter() - t0, 2)
    out["greedy_seconds"] = secs
    out["greedy_differ"] = sum(a != b for a, b in zip(g["fp32"], g["bf16"]))
    out["greedy_correct"] = {v: sum(task.verify(c[0], p.answer) for c, p in zip(g[v], problems)) for v in g}
    if not samples:
        return out
    sampled = SamplingParams(n=samples, temperature=0.6, max_new_tokens=task.max_new_tokens, seed=0)
    per = {}
    for v in ("fp32", "bf16"):
        comps = HFBackend(model, tok, compute_dtype=v).generate(texts, sampled)
        per[v] = [sum(task.verify(c, p.answer) for c in cs) / samples for cs, p in zip(comps, problems)]
    d = [b - a for a, b in zip(per["fp32"], per["bf16"])]
    se = statistics.stdev(d) / math.sqrt(len(d))
    out["sampled"] = {"samples": samples, "temperature": 0.6,
                      "pass_at_1": {v: round(statistics.fmean(x), 4) for v, x in per.items()},
                      "difference": round(statistics.fmean(d), 4), "paired_se": round(se, 4),
                      "within_2se": abs(statistics.fmean(d)) <= 2 * se}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--greedy-only", default=None, metavar="MODEL")
    ap.add_argument("--limit", type=int, default=100)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    t_start = time.time()
    if args.greedy_only:
        res = {"date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(),
               "load_average_before": [round(x, 2) for x in load0],
               "agreement": agreement(args.greedy_only, args.limit, samples=0),
               "load_average_after": [round(x, 2) for x in os.getloadavg()], "wall_s": round(time.time() - t_start, 1)}
        text = json.dumps(res, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return
    peaks = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        peaks[name] = {f"{m}x576x1536": round(matmul_gflops(m, 576, 1536, dt), 1) for m in (256, 64, 16)}
    models = {"tiny": load_model("tiny"), f"smollm2-shaped-{args.layers}L": smollm2_shaped(args.layers)}
    shapes = {"eval": (8, SamplingParams(n=8, temperature=0.6, max_new_tokens=32, seed=0)),
              "es": (16, SamplingParams(n=1, temperature=0.0, max_new_tokens=32))}
    rows = throughput(models, shapes, args.repeat, peaks)
    agree = agreement()
    res = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu_amx_bf16": "amx_bf16" in cpu_flags(), "auto_picks_bf16": bf16_is_fast("cpu"),
           "load_average_before": [round(x, 2) for x in load0],
           "load_average_after": [round(x, 2) for x in os.getloadavg()],
           "wall_s": round(time.time() - t_start, 1),
           "matmul_peak_gflops": peaks, "generation": rows, "agreement": agree}
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
