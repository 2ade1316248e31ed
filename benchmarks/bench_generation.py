"""HF (and vLLM, when installed) generation throughput in fp32 vs bf16 compute, prefill and decode apart,
beside this CPU's measured matmul peaks (the roofline fraction), and the agreement of bf16 with fp32.

    python benchmarks/bench_generation.py [--models tiny,smollm2-shaped,smollm2] [--repeat 3] [--threads N]
        [--layers 6] [--agreement-limit 100] [--out FILE]
    python benchmarks/bench_generation.py --greedy-only smollm2 [--limit 100] [--samples 16] [--threads N] [--out FILE]
    python benchmarks/bench_generation.py --models tiny --repeat 1 --agreement-limit 0 --peak-calls 3   # smoke
    python benchmarks/bench_generation.py --peak-only --threads 1 --out FILE   # the matmul peaks and CPU flags only

1. Peak: a 256x576x1536 matmul (SmolLM2-135M's MLP shape at 256 rows) in fp32 and bf16, best of 3
   timings of --peak-calls calls each; also at 64 and 16 rows, the rows of the decode shapes below.
2. Throughput of `HFBackend.generate` (what `deltalens eval` runs: token-budget batches, one prefill per
   distinct prompt, finished rows leaving the batch) on `tiny` (hidden 128, 4 layers), on a random
   char-level Llama of SmolLM2-135M's width (`smollm2-shaped`: hidden 576, 9 heads, 3 KV heads,
   intermediate 1536, --layers layers, vocabulary 99) and on the real SmolLM2-135M (`smollm2`, 30
   layers, vocabulary 49,152, its chat-template prompts), at two batch shapes: eval = 8 prompts x 8
   samples (64 rows), T=0.6, 32 new tokens; ES = 16 prompts x 1, greedy, 32 new tokens (one member's
   decoding at --prompts 16, the small-row regime). Variants: fp32, bf16 (the compute copy,
   `compute_dtype="bf16"`; its one cast per call is inside the timing) and fp32 weights under
   `torch.autocast(cpu, bfloat16)`, interleaved repeat by repeat so machine load hits all alike; with
   `vllm` importable, also vLLM fp32 and bf16 engines of the same weights (`VLLMBackend.from_model`),
   else a `vllm` entry saying why they were skipped. `bf16_strided_head`: bf16 with the LM head fed the
   strided last-position view as before the contiguous pre-hook (`contiguous_head`), the fix's before.
   Prefill and decode apart: `prefill_s` is the time of the prefill alone (the distinct prompts but
   their last token, left padded, one forward, as `HFBackend` runs it), `decode_s` the rest of the
   generate call. Tokens: prompt tokens prefilled (each distinct prompt once) and generated tokens up
   to and including EOS. Achieved FLOP/s = 2 x matmul parameters (all but the input embedding) x
   tokens / seconds (attention left out), and its fraction of the same run's 256-row matmul peak in
   that dtype (the roofline fraction), for prefill and decode apart and for the whole call.
3. Agreement on tiny, --agreement-limit arith test problems (0 skips it): greedy completions bf16 vs
   fp32 (how many differ), and sampled Pass@1 (8 samples, T=0.6) of each with the paired standard error
   of the difference over problems; `within_2se` says whether |difference| <= 2 SE. Both dtypes sample
   with the same seed and batches (common random numbers), which is what makes the paired SE small.
4. `--greedy-only MODEL`: only the greedy agreement (and the time of each dtype) on MODEL's default task,
   e.g. the real SmolLM2-135M (Q4_1 dequantized to fp32), which `auto` does switch to bf16; with
   `--samples N` also the sampled check of 3. at N samples (issue #32's: `--limit 200 --samples 16`).

Prints JSON (also written to --out) with the load average before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from deltalens.generation.batching import left_pad
from deltalens.generation.dtype import bf16_is_fast, cpu_flags
from deltalens.generation.prompts import problem_prompts
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


@torch.no_grad()
def prefill_seconds(be: HFBackend, texts, params) -> tuple[float, int]:
    """(seconds, tokens) of the prefill alone, as `HFBackend` runs it: the distinct prompts but their last
    token, left padded, one forward (n = 1: the whole prompts, which `generate` prefills itself)."""
    enc = be.encode(texts)
    seqs = [e[:-1] for e in enc] if params.n > 1 else enc
    ids, att = left_pad(seqs, be.tok.pad_token_id)
    pos = (att.cumsum(-1) - 1).masked_fill(att == 0, 0)
    runner = be.runner()
    t0 = time.perf_counter()
    runner(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0, sum(len(s) for s in seqs)


def vllm_backends(model, tok) -> dict:
    """vLLM fp32/bf16 engines of `model`'s weights, when vllm is importable; else {} (and why, printed)."""
    if importlib.util.find_spec("vllm") is None:
        return {}
    from deltalens.generation.vllm import VLLMBackend

    return {f"vllm_{d}": VLLMBackend.from_model(model, tok, dtype=d) for d in ("fp32", "bf16")}


def strided_head(be: HFBackend) -> HFBackend:
    """`be` with its compute copy's LM head fed the strided last-position view again (the contiguous
    pre-hook of `deltalens.io.models.contiguous_head` removed): the before of that fix, side by side."""
    head = be.runner().get_output_embeddings()
    head._forward_pre_hooks.clear()
    head._deltalens_contiguous = False
    return be


VARIANTS = ("fp32", "bf16", "bf16_strided_head", "autocast")


def hf_variant(variant: str, model, tok) -> HFBackend:
    """The HF backend of one variant (autocast: fp32 compute, run under torch.autocast by the caller)."""
    be = HFBackend(model, tok, compute_dtype="bf16" if variant.startswith("bf16") else "fp32")
    return strided_head(be) if variant == "bf16_strided_head" else be


def throughput(models, shapes, repeat: int, peaks: dict, variants=VARIANTS) -> list[dict]:
    arith = get_task("arith")
    rows = []
    for name, (model, tok, task) in models.items():
        task = task or arith
        n_params = matmul_params(model)
        backends = {v: hf_variant(v, model, tok) for v in variants}
        backends.update(vllm_backends(model, tok))
        for shape, (prompts, params) in shapes.items():
            texts = problem_prompts(task.test(prompts), backends["fp32"].chat)
            times: dict[str, list[float]] = {v: [] for v in backends}
            pre: dict[str, list[float]] = {v: [] for v in backends}
            toks: dict[str, int] = {}
            pre_toks = 0
            for v, be in backends.items():  # warm-up (and the bf16 copy's first allocation)
                with torch.autocast("cpu", torch.bfloat16, enabled=v == "autocast"):
                    be.generate(texts[:2], params)
            for _ in range(repeat):
                for v, be in backends.items():
                    with torch.autocast("cpu", torch.bfloat16, enabled=v == "autocast"):
                        if isinstance(be, HFBackend):
                            secs, pre_toks = prefill_seconds(be, texts, params)
                            pre[v].append(secs)
                        t0 = time.perf_counter()
                        out = be.generate(texts, params)
                        times[v].append(time.perf_counter() - t0)
                    toks[v] = tokens_of(tok, out)
            for v in backends:
                med = statistics.median(times[v])
                peak = peaks["fp32" if v in ("fp32", "vllm_fp32") else "bf16"]["256x576x1536"]
                flops = 2 * n_params * toks[v] / med
                row = {"model": name, "shape": shape, "rows": prompts * params.n, "variant": v,
                       "tokens": toks[v], "seconds_each": [round(t, 4) for t in times[v]],
                       "median_s": round(med, 4), "tokens_per_s": round(toks[v] / med, 1),
                       "gflops": round(flops / 1e9, 1), "roofline_fraction": round(flops / 1e9 / peak, 3)}
                if pre[v]:  # HF: prefill and decode apart
                    p_s = statistics.median(pre[v])
                    d_s = max(med - p_s, 1e-9)
                    row.update({"prefill_tokens": pre_toks, "prefill_s": round(p_s, 4),
                                "prefill_tokens_per_s": round(pre_toks / p_s, 1),
                                "prefill_roofline_fraction": round(2 * n_params * pre_toks / p_s / 1e9 / peak, 3),
                                "decode_s": round(d_s, 4), "decode_tokens_per_s": round(toks[v] / d_s, 1),
                                "decode_roofline_fraction": round(2 * n_params * toks[v] / d_s / 1e9 / peak, 3)})
                rows.append(row)
            base = statistics.median(times["fp32"])
            for r in rows[-len(backends):]:
                r["speedup_vs_fp32"] = round(base / r["median_s"], 2)
        for be in backends.values():
            if hasattr(be, "close"):
                be.close()
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
    per, secs = {}, {}
    for v in ("fp32", "bf16"):
        t0 = time.perf_counter()
        comps = HFBackend(model, tok, compute_dtype=v).generate(texts, sampled)
        secs[v] = round(time.perf_counter() - t0, 2)
        per[v] = [sum(task.verify(c, p.answer) for c in cs) / samples for cs, p in zip(comps, problems)]
    d = [b - a for a, b in zip(per["fp32"], per["bf16"])]
    se = statistics.stdev(d) / math.sqrt(len(d))
    out["sampled"] = {"samples": samples, "temperature": 0.6,
                      "pass_at_1": {v: round(statistics.fmean(x), 4) for v, x in per.items()},
                      "difference": round(statistics.fmean(d), 4), "paired_se": round(se, 4),
                      "within_2se": abs(statistics.fmean(d)) <= 2 * se, "seconds": secs,
                      "per_problem_correct": {v: [round(x * samples) for x in per[v]] for v in per}}
    return out


def cpu_description() -> dict:
    """The CPU's model name and the flags that decide bf16's speed (AMX-BF16, AVX-512-BF16, AVX-512F, AVX2)."""
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            name = next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    flags = cpu_flags()
    return {"model_name": name, **{f: f in flags for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2")}}


def module_at(rev: str, path: str):
    """The module at `path` (relative to the repository) as of commit `rev`, read with `git show` and
    imported under its own name: an old implementation to time beside the current one in one process."""
    import subprocess
    import tempfile

    src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    name = f"{Path(path).stem}_{rev}"
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(src)
    spec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def emit(res: dict, out: str | None) -> None:
    """Print the result as JSON, and write it to `out` when given."""
    text = json.dumps(res, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--greedy-only", default=None, metavar="MODEL",
                    help="only the agreement on MODEL's default task: greedy, plus sampled with --samples")
    ap.add_argument("--samples", type=int, default=0,
                    help="with --greedy-only: also the sampled check at this many samples per problem, T=0.6")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--models", default="tiny,smollm2-shaped,smollm2",
                    help="comma-separated: tiny, smollm2-shaped (random, --layers layers), smollm2 (real)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"HF variants, comma-separated (fp32 first): {', '.join(VARIANTS)}")
    ap.add_argument("--agreement-limit", type=int, default=100, help="tiny problems for the agreement (0: skip)")
    ap.add_argument("--peak-calls", type=int, default=20, help="matmul calls per peak timing")
    ap.add_argument("--peak-only", action="store_true",
                    help="only the fp32 and bf16 matmul peaks and the CPU's flags (what `auto` decides from)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    t_start = time.time()
    if args.greedy_only:
        res = {"date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(),
               "load_average_before": [round(x, 2) for x in load0],
               "agreement": agreement(args.greedy_only, args.limit, samples=args.samples),
               "load_average_after": [round(x, 2) for x in os.getloadavg()], "wall_s": round(time.time() - t_start, 1)}
        emit(res, args.out)
        return
    peaks = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        peaks[name] = {f"{m}x576x1536": round(matmul_gflops(m, 576, 1536, dt, calls=args.peak_calls), 1)
                       for m in (256, 64, 16)}
    if args.peak_only:
        res = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
               "cpu": cpu_description(), "auto_picks_bf16": bf16_is_fast("cpu"),
               "load_average_before": [round(x, 2) for x in load0],
               "load_average_after": [round(x, 2) for x in os.getloadavg()],
               "matmul_peak_gflops": peaks,
               "bf16_over_fp32": {k: round(peaks["bf16"][k] / peaks["fp32"][k], 2) for k in peaks["fp32"]}}
        emit(res, args.out)
        return
    models = {}
    for m in args.models.split(","):
        if m == "tiny":
            models["tiny"] = (*load_model("tiny"), None)
        elif m == "smollm2-shaped":
            models[f"smollm2-shaped-{args.layers}L"] = (*smollm2_shaped(args.layers), None)
        elif m == "smollm2":
            from deltalens.presets import default_task

            models["smollm2"] = (*load_model("smollm2"), get_task(default_task("smollm2")))
        else:
            ap.error(f"unknown model {m!r} in --models (tiny, smollm2-shaped, smollm2)")
    shapes = {"eval": (8, SamplingParams(n=8, temperature=0.6, max_new_tokens=32, seed=0)),
              "es": (16, SamplingParams(n=1, temperature=0.0, max_new_tokens=32))}
    variants = args.variants.split(",")
    if variants[0] != "fp32" or not set(variants) <= set(VARIANTS):
        ap.error(f"--variants: fp32 first, then any of {', '.join(VARIANTS[1:])}")
    rows = throughput(models, shapes, args.repeat, peaks, variants)
    agree = agreement(limit=args.agreement_limit) if args.agreement_limit else None
    res = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu_amx_bf16": "amx_bf16" in cpu_flags(), "cpu": cpu_description(), "auto_picks_bf16": bf16_is_fast("cpu"),
           "load_average_before": [round(x, 2) for x in load0],
           "load_average_after": [round(x, 2) for x in os.getloadavg()],
           "wall_s": round(time.time() - t_start, 1),
           "matmul_peak_gflops": peaks, "generation": rows, "agreement": agree,
           "vllm": None if importlib.util.find_spec("vllm") else "skipped: vllm is not importable here"}
    emit(res, args.out)


if __name__ == "__main__":
    main()
