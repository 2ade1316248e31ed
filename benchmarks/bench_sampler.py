"""One sampling step at SmolLM2's vocabulary: torch.multinomial against deltalens's inverse-CDF draw.

    python benchmarks/bench_sampler.py [--rows 64] [--vocab 49152] [--threads 1] [--out FILE]

Times (best of 30, after a warm-up) softmax + `torch.multinomial(probs, 1)`, what transformers' sampling does
each step, and `deltalens.generation.sampling.inverse_cdf_draw` on the same fp32 scores. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
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

    from deltalens.generation.sampling import inverse_cdf_draw

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    scores = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    res = {"date": time.strftime("%Y-%m-%d"), "rows": args.rows, "vocab": args.vocab, "threads": args.threads,
           "multinomial_ms": best_ms(lambda: torch.multinomial(scores.softmax(-1), 1)),
           "inverse_cdf_ms": best_ms(lambda: inverse_cdf_draw(scores))}
    res["ratio"] = round(res["multinomial_ms"] / res["inverse_cdf_ms"], 1)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
