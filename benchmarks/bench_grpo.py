"""GRPO step time by rollout dtype: TRL's fp32 `generate` on the policy vs deltalens's HF backend on a bf16
copy (`GRPOConfig.compute_dtype`), the rest of the step (log-probabilities, KL reference, loss, AdamW) fp32.

    python benchmarks/bench_grpo.py --model smollm2 --preset smollm2 --steps 3 --compute-dtype fp32,bf16 \
        --out benchmarks/results/bench_grpo-smollm2-amx-DATE.json

Each compute dtype trains a fresh run of `--steps` steps from the same base weights and seed into a temporary
directory (no held-out evaluation, no checkpoint but the final one). Per run: every step's wall time
(`timing.iteration_s` of its metrics row), the time inside rollout generation (`_generate_single_turn`,
timed around the call), the mean completion length TRL logged, and the rewards. The summary takes the
median over steps 2.. (step 1 also loads the KL reference). `speedup_vs_first` is the first dtype's median
step (and rollout) time over this one's: ratios measured side by side in one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(model: str, preset: str, steps: int, compute_dtype: str, seed: int, task: str | None = None) -> dict:
    import deltalens.training.grpo.train as grpo
    from deltalens.training.grpo.config import GRPOConfig

    make = grpo._trainer_class
    rollout_s: list[float] = []

    def timed_class():
        base = make()

        class Timed(base):
            def _generate_single_turn(self, *a, **k):
                t = time.perf_counter()
                try:
                    return super()._generate_single_turn(*a, **k)
                finally:
                    rollout_s.append(time.perf_counter() - t)

        return Timed

    cfg = GRPOConfig.preset(preset, model=model, steps=steps, eval_every=0, save_every=0, seed=seed,
                            compute_dtype=compute_dtype, **({"task": task} if task else {}))
    grpo._trainer_class = timed_class
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            out = grpo.train_grpo(cfg, Path(tmp) / "run")
            wall = time.perf_counter() - t0
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    finally:
        grpo._trainer_class = make
    rows = [r for r in rows if "reward_mean" in r]
    step_s = [r["timing"]["iteration_s"] for r in rows]
    later = slice(1, None) if len(rows) > 1 else slice(None)
    return {
        "compute_dtype": compute_dtype,
        "resolved": rows[0].get("compute_dtype"),
        "steps": len(rows),
        "step_s": step_s,
        "rollout_s": [round(x, 3) for x in rollout_s],
        "median_step_s": statistics.median(step_s[later]),
        "median_rollout_s": statistics.median(rollout_s[later]),
        "completion_length": [r.get("completion_length") for r in rows],
        "reward_mean": [r["reward_mean"] for r in rows],
        "wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--compute-dtype", default="fp32,bf16", help="comma-separated, run in this order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", default=None, help="task spec (default: GRPOConfig's, arith; e.g. SmolLM2's own "
                    "add:digits=1-2,terms=2,shots=2)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = ap.parse_args()

    import torch

    from deltalens.io.heap import keep_freed_memory

    malloc = "keep" if keep_freed_memory() else "trim"  # as the CLI does (DELTALENS_MALLOC)

    from deltalens.generation.dtype import cpu_flags

    results = [run(a.model, a.preset, a.steps, d, a.seed, a.task) for d in a.compute_dtype.split(",")]
    first = results[0]
    for r in results:
        r["speedup_vs_first"] = {"step": round(first["median_step_s"] / r["median_step_s"], 3),
                                 "rollout": round(first["median_rollout_s"] / r["median_rollout_s"], 3)}
    from deltalens.training.grpo.config import GRPOConfig

    doc = {"command": " ".join(sys.argv), "model": a.model, "preset": a.preset, "task": a.task or GRPOConfig().task, "malloc": malloc,
           "torch": torch.__version__,
           "threads": torch.get_num_threads(), "amx_bf16": "amx_bf16" in cpu_flags(), "results": results}
    text = json.dumps(doc, indent=2)
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
