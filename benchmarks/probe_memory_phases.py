"""Where `deltalens probe`'s peak resident memory sits, phase by phase (issue #32: "profile the probe's peak").

    python benchmarks/probe_memory_phases.py [--model smollm2] [--limit 8] [--samples 16] [--out FILE]

Runs `deltalens.analysis.probe.probe` in this process (the model's default task and ES preset, compute dtype
auto, as `deltalens probe MODEL` does) with a thread that samples the process's RSS every 50 ms, and keys each
sample by the probe's current log line (model load, the sampled pass at each temperature, the greedy pass, each
ES population). Prints JSON: the peak RSS per phase (kB), the RSS at each phase's start, and the KV budget
per batch (`deltalens.generation.batching`), one of the pieces the peak is made of. The batches are bounded by the token budget, not by limit x samples, so a small
--limit reaches the same per-batch peak once limit x samples fills a batch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time

import psutil

from deltalens.analysis.probe import probe
from deltalens.generation.batching import KV_BUDGET_BYTES
from deltalens.io.models import load_config
from deltalens.presets import auto_preset, default_task
from deltalens.tasks import get_task


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    proc = psutil.Process(os.getpid())
    phases: dict[str, dict] = {}
    current = ["load"]

    def rss() -> int:
        return proc.memory_info().rss // 1024

    def enter(name: str) -> None:
        phases.setdefault(name, {"rss_at_start_kB": rss(), "peak_rss_kB": 0})
        current[0] = name

    def sample() -> None:
        while True:
            p = phases[current[0]]
            p["peak_rss_kB"] = max(p["peak_rss_kB"], rss())
            time.sleep(0.05)

    enter("load")
    threading.Thread(target=sample, daemon=True).start()
    t0 = time.time()
    out = probe(args.model, get_task(default_task(args.model)), limit=args.limit, samples=args.samples,
                es_preset=auto_preset(args.model), compute_dtype="auto", log=enter)
    time.sleep(0.2)
    cfg = load_config(args.model)
    res = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "limit": args.limit, "samples": args.samples,
           "temperatures": out["temperatures"], "es_preset": auto_preset(args.model),
           "phases": phases, "maxrss_kB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
           "kv_budget_bytes_per_batch": KV_BUDGET_BYTES,
           "hidden_size": cfg.hidden_size, "layers": cfg.num_hidden_layers, "wall_s": round(time.time() - t0)}
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
