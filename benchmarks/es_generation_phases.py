"""Where one population-batched ES generation spends its time, module by module, prefill apart from decode.

    python benchmarks/es_generation_phases.py [--model smollm2] [--preset smollm2] [--compute-dtype bf16]
        [--max-new-tokens 80] [--out FILE]

Builds the ES engine of the preset (as `bench_es.py` does), evaluates iteration 1 once as a warm-up, then
again with forward hooks that time every decoder sub-module (q/k/v/o projections, attention, MLP and its
projections, norms, LM head) and the model's whole forward, each keyed by prefill (input width > 1) or
decode (one new token), plus the time `generate` spends between two forwards (logits to fp32, argmax,
stopping) and every `scaled_dot_product_attention` call. Hooks cost a few microseconds a call, so the
total runs a little above `bench_es.py`'s generation_s. Prints JSON (also to --out): seconds per key,
`attention_other_s` (attention less its projections: rotary, cache update, SDPA, reshapes), SDPA seconds
and mean milliseconds per call by key length.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "self_attn", "mlp",
         "input_layernorm", "post_attention_layernorm", "lm_head", "norm", "embed_tokens")


def main(argv=None) -> None:
    import torch
    import torch.nn.functional as F
    from bench_generation import emit

    from deltalens.io.models import load_model
    from deltalens.training.es.backends import LocalBackend
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.engine import ESEngine
    from deltalens.training.es.strategy import iteration_problems
    from deltalens.training.run import make_task

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--compute-dtype", default="bf16")
    ap.add_argument("--max-new-tokens", type=int, default=80)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    model, tok = load_model(args.model, dtype="fp32")
    cfg = ESConfig.preset(args.preset, model=args.model, iterations=1, dtype="fp32", eval_every=0,
                          compute_dtype=args.compute_dtype, max_new_tokens=args.max_new_tokens)
    engine = ESEngine(model, tok, make_task(cfg), cfg)
    backend = LocalBackend(engine)
    problems = iteration_problems(engine.task, cfg, 1)
    t0 = time.perf_counter()
    backend.evaluate(1, problems)
    warm = time.perf_counter() - t0
    runner = engine.compute_model()

    secs: dict[str, float] = collections.defaultdict(float)
    mode, start, last = ["prefill"], {}, [None]

    def model_pre(mod, a, kw):
        ids = kw.get("input_ids", a[0] if a else None)
        mode[0] = "prefill" if ids.shape[1] > 1 else "decode"
        if last[0] is not None:
            secs[f"{mode[0]}:between_forwards"] += time.perf_counter() - last[0]
        start[mod] = time.perf_counter()

    def model_post(mod, a, kw, out):
        secs[f"{mode[0]}:forward"] += time.perf_counter() - start[mod]
        last[0] = time.perf_counter()

    runner.register_forward_pre_hook(model_pre, with_kwargs=True)
    runner.register_forward_hook(model_post, with_kwargs=True)

    def timed(name):
        def pre(mod, a):
            start[mod] = time.perf_counter()

        def post(mod, a, out):
            secs[f"{mode[0]}:{name}"] += time.perf_counter() - start[mod]
        return pre, post

    for name, mod in runner.named_modules():
        part = name.rsplit(".", 1)[-1]
        if part in PARTS:
            pre, post = timed(part)
            mod.register_forward_pre_hook(pre)
            mod.register_forward_hook(post)

    sdpa_calls: dict[int, list[float]] = collections.defaultdict(list)
    sdpa = F.scaled_dot_product_attention

    def timed_sdpa(q, k, v, *a, **kw):
        t = time.perf_counter()
        out = sdpa(q, k, v, *a, **kw)
        if q.shape[-2] <= 8:  # decode (a packed GQA query holds heads / KV heads rows)
            sdpa_calls[k.shape[-2] // 20 * 20].append(time.perf_counter() - t)
        else:
            secs["prefill:sdpa"] += time.perf_counter() - t
        return out

    import transformers.integrations.sdpa_attention as sdpa_mod

    sdpa_mod.torch.nn.functional.scaled_dot_product_attention = timed_sdpa
    try:
        t0 = time.perf_counter()
        _, timing = backend.evaluate(1, problems)
        total = time.perf_counter() - t0
    finally:
        sdpa_mod.torch.nn.functional.scaled_dot_product_attention = sdpa
    for m in ("prefill", "decode"):
        proj = sum(secs[f"{m}:{p}"] for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        secs[f"{m}:attention_other"] = secs[f"{m}:self_attn"] - proj
    secs["decode:sdpa"] = sum(sum(v) for v in sdpa_calls.values())
    res = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "preset": args.preset,
           "compute_dtype": engine.compute_dtype, "max_new_tokens": engine.max_new_tokens,
           "torch_threads": torch.get_num_threads(), "warm_up_s": round(warm, 2), "total_s": round(total, 2),
           "completion_tokens": timing.get("completion_tokens"),
           "seconds": {k: round(v, 3) for k, v in sorted(secs.items())},
           "decode_sdpa_ms_per_call_by_key_length": {f"{k}-{k + 19}": round(1e3 * sum(v) / len(v), 3)
                                                     for k, v in sorted(sdpa_calls.items())}}
    emit(res, args.out)


if __name__ == "__main__":
    main()
