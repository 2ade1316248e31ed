"""GRPO step time and peak memory by rollout dtype, micro-batch, loss-pass autocast and activation
checkpointing: TRL's fp32 `generate` on the policy vs deltalens's HF backend on a bf16 copy
(`GRPOConfig.compute_dtype`); all P·G completions in one forward/backward vs `--micro-batch` of them; the
loss pass (log-probabilities, KL reference, loss, backward) in fp32 or under bf16 autocast (`--autocast
none,bf16`: `GRPOConfig.autocast`, the weights, their gradients and AdamW staying fp32); activations kept for
backward or recomputed in it (`--checkpointing off,on`: `GRPOConfig.gradient_checkpointing`).

    python benchmarks/bench_grpo.py --model smollm2 --preset smollm2 --steps 3 --compute-dtype fp32,bf16 \
        --out benchmarks/results/bench_grpo-smollm2-amx-DATE.json
    python benchmarks/bench_grpo.py --model smollm2 --preset smollm2 --steps 3 --compute-dtype auto \
        --micro-batch all,8 --task add:digits=1-2,terms=2,shots=2
    python benchmarks/bench_grpo.py --model smollm2 --preset smollm2 --steps 3 --compute-dtype auto \
        --micro-batch 8 --autocast none,bf16 --task add:digits=1-2,terms=2,shots=2
    DELTALENS_MALLOC=trim python benchmarks/bench_grpo.py --model qwen2.5-0.5b --preset qwen2.5 --steps 2 \
        --compute-dtype auto --micro-batch 8,4 --checkpointing off,on --task add:digits=1-2,terms=3,shots=2

Each (compute dtype, micro-batch, autocast, checkpointing) configuration, in that order, trains a fresh run in
its own child process (so `peak_rss_kb`, the child's getrusage maximum resident set, is that run's alone; the
heap setting is the CLI's, DELTALENS_MALLOC) of `--steps` steps from the same base weights and seed into a
temporary directory (no held-out evaluation, no checkpoint but the final one). Per run: every step's wall time
(`timing.iteration_s` of its metrics row), the time inside rollout generation (`_generate_single_turn`, timed
around the call), the rest of the step (`loss_s`: step minus rollouts), the mean completion length TRL
logged, the rewards, and resident memory by phase of the step (`phases`: rollout, score = TRL's
old/reference log-probabilities and rewards, loss = the loss pass's forward, backward, clip, optimizer; each
phase's peak and its rise over its entry: `Phases`). The summary takes the median over steps 2.. (step 1 also
loads the KL reference). `speedup_vs_first` is the first configuration's median step (rollout, loss pass)
time over this one's, and this one's peak over the first's: ratios measured side by side in one invocation.
Runs before 2026-12-06 put every dtype in one process (no peak per run). A child that fails (e.g. killed for
memory) is recorded as {"failed": why}, the other configurations still run, and the script exits 1.
`--micro-batch all` means all P·G completions at once, also for a preset with a `max_micro_batch` cap (the
smollm2 preset's 8, which `--micro-batch 8` measures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(model: str, preset: str, steps: int, compute_dtype: str, seed: int, task: str | None = None,
        micro_batch: int | None = None, work: Path | None = None, autocast: str = "none",
        checkpointing: bool = False) -> dict:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

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
                    with phases("rollout"):
                        return super()._generate_single_turn(*a, **k)
                finally:
                    rollout_s.append(time.perf_counter() - t)

        def labelled(method: str, phase: str):
            def call(self, *a, **k):
                with phases(phase):
                    return getattr(super(Timed, self), method)(*a, **k)
            return call

        # TRL's training_step holds score (its first micro-batch generates) and loss: "backward" is the rest
        for method, phase in (("_generate_and_score_completions", "score"), ("training_step", "backward"),
                              ("compute_loss", "loss"), ("_clip_grad_norm", "clip")):
            setattr(Timed, method, labelled(method, phase))
        return Timed

    cfg = GRPOConfig.preset(preset, model=model, steps=steps, eval_every=0, save_every=0, seed=seed,
                            compute_dtype=compute_dtype, autocast=autocast,
                            gradient_checkpointing=checkpointing,
                            # all at once: also past a preset's max_micro_batch cap
                            **({"max_micro_batch": None} if micro_batch is None
                               else {"micro_batch_size": micro_batch}),
                            **({"task": task} if task else {}))
    phases = Phases()
    grpo._trainer_class = timed_class
    hooks = (register_optimizer_step_pre_hook(lambda *_: phases.enter("optimizer")),
             register_optimizer_step_post_hook(lambda *_: phases.leave()))
    try:
        with (contextlib.nullcontext(work) if work is not None else tempfile.TemporaryDirectory()) as tmp:
            t0 = time.perf_counter()  # `work`: the parent's temporary directory, removed even if this child is killed
            out = grpo.train_grpo(cfg, Path(tmp) / "run")
            wall = time.perf_counter() - t0
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    finally:
        grpo._trainer_class = make
        for h in hooks:
            h.remove()
        phases.stop()
    rows = [r for r in rows if "reward_mean" in r]
    step_s = [r["timing"]["iteration_s"] for r in rows]
    later = slice(1, None) if len(rows) > 1 else slice(None)
    return {
        "compute_dtype": compute_dtype,
        "resolved": rows[0].get("compute_dtype"),
        "micro_batch": micro_batch or cfg.prompts_per_step * cfg.num_generations,
        "autocast": autocast,
        "checkpointing": checkpointing,
        "steps": len(rows),
        "step_s": step_s,
        "rollout_s": [round(x, 3) for x in rollout_s],
        "median_step_s": statistics.median(step_s[later]),
        "median_rollout_s": statistics.median(rollout_s[later]),
        "median_loss_s": round(statistics.median([s - g for s, g in zip(step_s, rollout_s)][later]), 3),
        "completion_length": [r.get("completion_length") for r in rows],
        "reward_mean": [r["reward_mean"] for r in rows],
        "wall_s": round(wall, 2),
        "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,  # Linux: kB
        "phases": phases.summary(),
    }


class Phases:
    """Resident memory by phase of a GRPO step, sampled every `every` s from /proc/self/statm on a thread.

    `with phases(name)` labels the time inside it (nested labels: the innermost counts, so "backward",
    TRL's training_step, is what is left of it outside "score" and "loss"). Per phase: `peak_rss_kb`, the
    highest sample in it over the run; `entry_rss_kb`, the resident size when it was entered at that peak's
    occurrence; `rise_kb`, the largest peak minus entry of one occurrence (`rises_kb`: every occurrence's, in
    order): an innermost phase's own transient, while an outer phase's rise also holds what its inner phases
    left resident (the first micro-batch's "backward" holds that step's "score": the reference paged in, the
    bf16 copy). Time outside every label (step bookkeeping, the final save) is "other"."""

    def __init__(self, every: float = 0.02):
        import threading

        from deltalens.io.usage import rss_kb

        self.rss = rss_kb
        self.every = every
        self.stack: list[tuple[str, int, list[int]]] = []  # (name, entry RSS, [peak in this occurrence])
        self.out: dict[str, dict] = {}
        self._lock = threading.Lock()  # the stack and `out` are changed by the caller and read by the sampler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.every):
            now = self.rss() or 0
            with self._lock:
                if self.stack:
                    top = self.stack[-1][2]
                    top[0] = max(top[0], now)
                else:
                    self._record("other", now, now)

    def _record(self, name: str, entry: int, peak: int) -> None:
        row = self.out.setdefault(name, {"peak_rss_kb": 0, "entry_rss_kb": 0, "rise_kb": 0, "occurrences": 0,
                                         "rises_kb": []})
        if peak > row["peak_rss_kb"]:
            row["peak_rss_kb"], row["entry_rss_kb"] = peak, entry
        row["rise_kb"] = max(row["rise_kb"], peak - entry)
        if name != "other":
            row["occurrences"] += 1
            row["rises_kb"].append(peak - entry)  # in order: step 1's micro-batches first

    def enter(self, name: str) -> None:
        now = self.rss() or 0
        with self._lock:
            if self.stack:  # the outer phase's peak so far, before the inner one takes over
                self.stack[-1][2][0] = max(self.stack[-1][2][0], now)
            self.stack.append((name, now, [now]))

    def leave(self) -> None:
        now = self.rss() or 0
        with self._lock:
            name, entry, peak = self.stack.pop()
            self._record(name, entry, max(peak[0], now))

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.enter(name)
        try:
            yield
        finally:
            self.leave()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        return {k: dict(v) for k, v in sorted(self.out.items(), key=lambda kv: -kv[1]["peak_rss_kb"])}


def run_child(a: argparse.Namespace, compute_dtype: str, micro: int | None, autocast: str, ckpt: str) -> dict:
    """One configuration in a fresh interpreter (its own peak memory), its result read back as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        cmd = [sys.executable, __file__, "--one", str(out), "--work", tmp, "--model", a.model, "--preset", a.preset,
               "--steps", str(a.steps), "--compute-dtype", compute_dtype, "--seed", str(a.seed),
               "--micro-batch", "all" if micro is None else str(micro), "--autocast", autocast,
               "--checkpointing", ckpt,
               *(["--task", a.task] if a.task else [])]
        rc = subprocess.run(cmd, check=False).returncode
        if rc == 0:
            return json.loads(out.read_text())
        # e.g. killed for memory (-9): recorded, and the other configurations still run
        why = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
        label = "all" if micro is None else micro
        print(f"bench_grpo: {compute_dtype}, micro-batch {label}, autocast {autocast}, checkpointing {ckpt}: "
              f"the child failed ({why})", file=sys.stderr)
        return {"compute_dtype": compute_dtype, "micro_batch": label, "autocast": autocast,
                "checkpointing": ckpt == "on", "failed": why}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--compute-dtype", default="fp32,bf16", help="comma-separated, run in this order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", default=None, help="task spec (default: GRPOConfig's, arith; e.g. SmolLM2's own "
                    "add:digits=1-2,terms=2,shots=2)")
    ap.add_argument("--micro-batch", default="all", help="comma-separated completions per forward/backward, "
                    "'all' = P·G at once (the default; the smollm2 preset's own cap, 8, is not applied)")
    ap.add_argument("--autocast", default="none", help="comma-separated loss-pass autocast: none (fp32, the default) "
                    "and/or bf16 (GRPOConfig.autocast)")
    ap.add_argument("--checkpointing", default="off", help="comma-separated: off (activations kept for "
                    "backward, the default) and/or on (recomputed in backward: "
                    "GRPOConfig.gradient_checkpointing)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--one", type=Path, default=None, help=argparse.SUPPRESS)  # a child: one configuration
    ap.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)  # the child's run directory's parent
    a = ap.parse_args()
    micros = [None if m.strip() == "all" else int(m) for m in a.micro_batch.split(",")]
    checks = [g.strip() for g in a.checkpointing.split(",")]
    if not set(checks) <= {"off", "on"}:
        ap.error(f"--checkpointing: off and/or on (got {a.checkpointing})")

    import torch

    from deltalens.io.heap import keep_freed_memory

    malloc = "keep" if keep_freed_memory() else "trim"  # as the CLI does (DELTALENS_MALLOC)

    from deltalens.generation.dtype import cpu_flags

    if a.one is not None:
        res = run(a.model, a.preset, a.steps, a.compute_dtype, a.seed, a.task, micros[0], a.work, a.autocast,
                  a.checkpointing == "on")
        res["malloc"] = malloc
        a.one.write_text(json.dumps(res))
        return
    results = [run_child(a, d, m, c, g) for d in a.compute_dtype.split(",") for m in micros
               for c in a.autocast.split(",") for g in checks]
    first = results[0]
    for r in results:
        if "failed" in r or "failed" in first:
            continue  # no ratio against or of a configuration that did not finish
        r["speedup_vs_first"] = {"step": round(first["median_step_s"] / r["median_step_s"], 3),
                                 "rollout": round(first["median_rollout_s"] / r["median_rollout_s"], 3),
                                 "loss": round(first["median_loss_s"] / r["median_loss_s"], 3),
                                 "peak_rss": round(r["peak_rss_kb"] / first["peak_rss_kb"], 3)}
    from deltalens.training.grpo.config import GRPOConfig

    doc = {"command": " ".join(sys.argv), "model": a.model, "preset": a.preset, "task": a.task or GRPOConfig().task, "malloc": malloc,
           "torch": torch.__version__,
           "threads": torch.get_num_threads(), "amx_bf16": "amx_bf16" in cpu_flags(), "results": results}
    text = json.dumps(doc, indent=2)
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    if any("failed" in r for r in results):
        sys.exit(1)  # recorded above, but not a clean measurement


if __name__ == "__main__":
    main()
