"""The step-level pieces behind `deltalens/generation/decode.py`'s choices, timed side by side in one process.

    python benchmarks/bench_decode_pieces.py [--out F]

One thread, best of 7, on [214, 49,152] (SmolLM2's eval batch x vocabulary): argmax vs `max(-1).indices` in
fp32 and bf16 (and whether they agree); the inverse-CDF draw as of 3e79e43 (running sums over the whole
vocabulary; its source read with `git show`) vs the draw now (block sums), and how many of 5,440 seeded
draws (20 seeds x vocabularies 3, 256, 785, 49,152, 151,936) differ between them. Prints JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from bench_generation import emit, module_at

from deltalens.generation import sampling as now


def best(fn, x, reps=7) -> float:
    t = 1e9
    for _ in range(reps):
        y = x.clone()
        t0 = time.perf_counter()
        fn(y)
        t = min(t, time.perf_counter() - t0)
    return round(t * 1e3, 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "shape": [214, 49152]}
    for dt in (torch.float32, torch.bfloat16):
        x = (torch.randn(214, 49152, generator=torch.Generator().manual_seed(0)) * 3).to(dt)
        name = str(dt).replace("torch.", "")
        out[f"argmax_ms_{name}"] = best(lambda v: v.argmax(-1), x)
        out[f"max_indices_ms_{name}"] = best(lambda v: v.max(-1).indices, x)
        out[f"agree_{name}"] = bool((x.argmax(-1) == x.max(-1).indices).all())
    old = module_at("3e79e43", "deltalens/generation/sampling.py")
    x = torch.randn(214, 49152, generator=torch.Generator().manual_seed(1)) * 4
    out["draw_ms_3e79e43"] = best(lambda v: old.inverse_cdf_draw_(v, 0.6), x)
    out["draw_ms_now"] = best(lambda v: now.inverse_cdf_draw_(v, 0.6), x)
    differ = total = 0
    for seed in range(20):
        for vocab in (3, 256, 3 * 256 + 17, 49152, 151936):
            s = torch.randn(64 if vocab < 100000 else 16, vocab, generator=torch.Generator().manual_seed(seed)) * 4
            torch.manual_seed(seed)
            a = old.inverse_cdf_draw_(s.clone(), 0.6)
            torch.manual_seed(seed)
            b = now.inverse_cdf_draw_(s.clone(), 0.6)
            differ, total = differ + int((a != b).sum()), total + a.numel()
    out["draws_differing"], out["draws"] = differ, total
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
