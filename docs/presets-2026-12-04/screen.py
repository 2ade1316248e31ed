"""Screen candidate default tasks for a model on the first LIMIT validation problems (never test).

    python docs/presets-2026-12-04/screen.py MODEL OUT.jsonl LIMIT SAMPLES TASK [TASK ...]

For each task: greedy Pass@1, then (SAMPLES > 0) sampled Pass@1/4/SAMPLES at T = 0.6: the `evaluate` calls of

    deltalens eval MODEL --task T --split validation --limit LIMIT --samples 1 --temperature 0 --k 1
    deltalens eval MODEL --task T --split validation --limit LIMIT --samples SAMPLES --temperature 0.6 --k 1,4,SAMPLES

in one process with one model load (compute dtype auto, chat template auto). One JSON line per task is
printed and appended to OUT.jsonl. The rows of 2026-12-04 are screen.jsonl beside this file (docs/tuning.md).
"""

from __future__ import annotations

import json
import sys
import time

from deltalens.evaluation.evaluate import evaluate
from deltalens.io.models import load_model
from deltalens.tasks import get_task


def main(argv: list[str]) -> int:
    if len(argv) < 5 or not argv[2].isdigit() or not argv[3].isdigit():
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    model_name, out, limit, samples, specs = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4:]
    tasks = [get_task(spec) for spec in specs]  # every spec checked before the model loads
    model, tok = load_model(model_name)
    for spec, task in zip(specs, tasks):
        row = {"model": model_name, "task": spec, "limit": limit}
        t = time.time()
        g = evaluate(model, tok, task, samples=1, ks=(1,), temperature=0.0, limit=limit, split="validation",
                     model_spec=model_name, compute_dtype="auto", keep_completions=1)
        row["greedy"] = {k: g[k] for k in ("pass_at_k", "format_rate", "compute_dtype")}
        row["greedy_examples"] = [r["completions"][0][:80] for r in g["per_problem"][:3]]
        if samples:
            s = evaluate(model, tok, task, samples=samples, ks=sorted({1, min(4, samples), samples}), temperature=0.6, limit=limit,
                         split="validation", model_spec=model_name, compute_dtype="auto")
            row["sampled"] = {k: s[k] for k in ("pass_at_k", "maj_at_k", "format_rate")}
        row["seconds"] = round(time.time() - t, 1)
        print(json.dumps(row), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
