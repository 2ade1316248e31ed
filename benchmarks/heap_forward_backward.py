"""Where a GRPO-sized training pass spends its time on this VM: user vs system (page-fault) time.

    python benchmarks/heap_forward_backward.py                      # glibc's defaults
    MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=17179869184 \
        python benchmarks/heap_forward_backward.py                  # freed memory kept (set before start)

SmolLM2-135M in fp32, training mode: `--iterations` forward + backward passes of a random (32, 165) batch
(the size of a `smollm2`-preset GRPO step: 4 prompts x 8 completions of ~148 prompt + ~17 completion
tokens) with a log-softmax-and-gather loss over the whole vocabulary, then one forward without gradients.
Prints, per pass, the wall seconds and the process's user and system CPU seconds and minor page faults
(`getrusage`). No deltalens code is timed except the model loader; the environment variables are glibc's
own (mallopt(3)); `deltalens.io.heap.keep_freed_memory` sets the same from inside a process.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=165)
    a = ap.parse_args()

    import torch

    from deltalens.io.models import load_model

    model, _ = load_model(a.model)
    model.train()
    x = torch.randint(0, model.config.vocab_size, (a.rows, a.tokens))
    for i in range(a.iterations):
        u0, s0, f0 = usage()
        t = time.perf_counter()
        logits = model(input_ids=x, use_cache=False).logits
        t1 = time.perf_counter()
        torch.log_softmax(logits.float(), -1).gather(-1, x.unsqueeze(-1)).mean().backward()
        t2 = time.perf_counter()
        u1, s1, f1 = usage()
        model.zero_grad(set_to_none=True)
        del logits
        print(f"pass {i + 1}: forward {t1 - t:.1f} s, forward + backward {t2 - t:.1f} s, user {u1 - u0:.1f} s, "
              f"system {s1 - s0:.1f} s, minor faults {f1 - f0}", flush=True)
    with torch.no_grad():
        u0, s0, f0 = usage()
        t = time.perf_counter()
        model(input_ids=x, use_cache=False)
        u1, s1, f1 = usage()
        print(f"forward without gradients: {time.perf_counter() - t:.1f} s, user {u1 - u0:.1f} s, "
              f"system {s1 - s0:.1f} s, minor faults {f1 - f0}")


if __name__ == "__main__":
    main()
