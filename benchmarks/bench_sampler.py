"""One sampling step at SmolLM2's vocabulary: torch.multinomial against deltalens's inverse-CDF draw.

    python benchmarks/bench_sampler.py [--rows 64] [--vocab 49152] [--threads 1] [--out FILE]

Times (best of 30, after a warm-up) on the same scores:
- the draw alone: softmax + `torch.multinomial(probs, 1)` (what transformers' sampling does) against
  `deltalens.generation.sampling.inverse_cdf_draw`, on fp32 scores;
- the whole step after the forward pass, from the bf16 logits [rows, 1, V] of a bf16 compute copy to the
  token ids, at T=0.6: transformers' own (fp32 copy, temperature, softmax, multinomial); the draw as a
  separate pass over new tensors (temperature, the draw, an output tensor of -inf, argmax: how deltalens
  ran it at first); and what `sampling_kwargs` wires into `generate` now (the draw in place in generate's
  fp32 copy, temperature inside it, then argmax).
Prints JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def best_ms(fn, n: int = 30) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


def main(argv=None) -> None:
    import torch
    from bench_generation import emit
    from transformers import TemperatureLogitsWarper

    from deltalens.generation.sampling import inverse_cdf_draw, sampling_kwargs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    # spread like SmolLM2-135M-Instruct's logits (std 2.9-4.0 over the last 8 positions of a chat prompt)
    scores = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3.5
    res = {"date": time.strftime("%Y-%m-%d"), "rows": args.rows, "vocab": args.vocab, "threads": args.threads,
           "multinomial_ms": best_ms(lambda: torch.multinomial(scores.softmax(-1), 1)),
           "inverse_cdf_ms": best_ms(lambda: inverse_cdf_draw(scores))}
    res["ratio"] = round(res["multinomial_ms"] / res["inverse_cdf_ms"], 1)
    logits = scores.to(torch.bfloat16).unsqueeze(1)  # [rows, 1, V], as a bf16 forward returns them
    warp, procs = TemperatureLogitsWarper(0.6), sampling_kwargs(0.6)["logits_processor"]

    def fp32():  # generate's own copy of the last position's logits
        return logits[:, -1].to(copy=True, dtype=torch.float32)

    def separate():
        s = warp(None, fp32())
        return torch.full_like(s, float("-inf")).scatter_(1, inverse_cdf_draw(s).unsqueeze(1), 0.0).argmax(-1)

    res["step_T0.6_ms"] = {
        "transformers_multinomial": best_ms(lambda: torch.multinomial(warp(None, fp32()).softmax(-1), 1)),
        "draw_separate_passes": best_ms(separate),
        "draw_in_place": best_ms(lambda: procs(None, fp32()).argmax(-1))}
    emit(res, args.out)


if __name__ == "__main__":
    main()
