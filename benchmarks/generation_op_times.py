"""Where an HF generation batch spends its time, op by op: torch dispatch timing (not torch.profiler).

    python benchmarks/generation_op_times.py [--shape eval|es] [--threads 1] [--copies] [--prompts P] [--samples S] [--tokens T]

One SmolLM2 batch through `HFBackend` in bf16, at the shapes of bench_generation.py (eval: 8 prompts x 8
samples at T = 0.6; es: 16 prompts, greedy; 32 new tokens; `--prompts 7 --samples 32 --tokens 96` is one
batch of `deltalens eval`'s shape), after a warm-up: its plain wall time, then the
same call under a TorchDispatchMode that times every aten op, summed by op and by whether it ran in a
decoding step (one query token) or elsewhere. `--copies`: each row holding a copy of its prompt's cache
(`share_prompts=False`, the backend before 2026-12-06). torch.profiler put 37-41 ms on a logits copy that
takes 1.7 ms when timed in place, hence this timer; the mode's own overhead (~10 us an op) inflates the
sum of small ops, so read the large rows. Prints the table; no JSON.
"""

import argparse
import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltalens.generation.hf import HFBackend
from deltalens.generation.params import SamplingParams
from deltalens.generation.prompts import problem_prompts
from deltalens.io.models import load_model
from deltalens.presets import default_task
from deltalens.tasks import get_task


class OpTimes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.total = collections.defaultdict(lambda: [0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter() - t0
        a0 = next((a for a in args if isinstance(a, torch.Tensor)), None)
        decoding = a0 is not None and a0.dim() >= 2 and (a0.shape[-2] == 1 or (a0.dim() == 4 and a0.shape[-2] <= 3))
        row = self.total[(str(func).replace("aten.", ""), "decode" if decoding else "other")]
        row[0] += 1
        row[1] += dt
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=("eval", "es"), default="eval")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--copies", action="store_true")
    ap.add_argument("--rows", type=int, default=25, help="ops to print")
    ap.add_argument("--prompts", type=int, help="prompts of the batch (default: the shape's, 8 or 16)")
    ap.add_argument("--samples", type=int, help="samples per prompt of the eval shape (default 8; the evaluation's 32)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens at most (the evaluation's 96)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2")
    task = get_task(default_task("smollm2"))
    be = HFBackend(model, tok, compute_dtype="bf16", share_prompts=not args.copies)
    if args.shape == "eval":
        n_prompts = args.prompts or 8
        params = SamplingParams(n=args.samples or 8, temperature=0.6, max_new_tokens=args.tokens, seed=0)
    else:
        n_prompts, params = args.prompts or 16, SamplingParams(n=1, temperature=0.0, max_new_tokens=args.tokens)
    texts = problem_prompts(task.test(n_prompts), be.chat)
    be.generate(texts[:2], params)  # warm-up, and the bf16 copy
    t0 = time.perf_counter()
    be.generate(texts, params)
    print(f"plain: {time.perf_counter() - t0:.3f} s")
    timer = OpTimes()
    with timer:
        t0 = time.perf_counter()
        be.generate(texts, params)
        wall = time.perf_counter() - t0
    print(f"under the timer: {wall:.3f} s, ops {sum(c for c, _ in timer.total.values())}, "
          f"summed {sum(s for _, s in timer.total.values()):.3f} s")
    for (op, where), (count, secs) in sorted(timer.total.items(), key=lambda kv: -kv[1][1])[:args.rows]:
        print(f"{secs * 1e3:9.1f} ms {count:7d} calls  {where:6s} {op}")


if __name__ == "__main__":
    main()
