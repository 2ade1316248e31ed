"""Per-model defaults: the task and the hyperparameter preset a model spec gets when none is given.

    tiny      task `arith` (what it was SFT'd on), presets `tiny` (ESConfig / GRPOConfig.PRESETS)
    smollm2   task SMOLLM2_TASK, presets `smollm2`; chosen on validation problems only
              (docs/tuning.md: "SmolLM2-135M-Instruct")
    qwen2.5-0.5b
              task QWEN05_TASK, chosen on validation problems only (docs/tuning.md: "Qwen2.5-Coder-0.5B-Instruct
              and Gemma-3-270M"); presets `qwen2.5` (ES chosen on validation; GRPO's not checked yet:
              docs/tuning.md "ES on Qwen2.5-Coder-0.5B").
    qwen2.5-1.5b
              task QWEN15_TASK, chosen on validation problems only (docs/tuning.md: "Qwen2.5-Coder-1.5B-Instruct:
              a default task"); presets `qwen2.5` (the 0.5B's, by weight scale: matrix median |w| ~0.011 in both;
              not tuned on the 1.5B)
    gemma3-270m
              task GEMMA3_TASK, chosen on validation problems only (docs/tuning.md: "Gemma-3-270M: a default
              task with stop strings"): the best of those screened, below the rule's sampled Pass@1 band
              (0.125 at T = 0.6) with greedy 0.21 inside it; presets `paper` (none of its own)
    a deltalens run directory (or a checkpoint inside one): the task it was trained on (its config.json)
    anything else: no default task (`arith` is used), presets `paper` (the paper's settings)

`deltalens eval`, `probe` and `train` use these when --task / --preset are not given; an explicit option
always wins. Torch-free.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SMOLLM2_TASK = "add:digits=1-2,terms=2,shots=2"  # base Pass@1 ~0.35, Pass@16 ~0.54 (validation)
# Qwen2.5-Coder-0.5B-Instruct: greedy 0.54, sampled Pass@1 0.41, Pass@16 0.96 (24 validation problems, T=0.6);
# SmolLM2's 1-2 digit pairs are too easy for it (greedy 0.92)
QWEN05_TASK = "add:digits=1-2,terms=3,shots=2"
# Qwen2.5-Coder-1.5B-Instruct: greedy 0.33, sampled Pass@1 0.22, Pass@16 0.63 (24 validation problems, T=0.6); the
# 0.5B's task is too easy for it (greedy 0.83); addition only, as the 0.5B's and SmolLM2's, one term more
QWEN15_TASK = "add:digits=2,terms=4,shots=2"
# Gemma-3-270M (base, plain 8-shot prompts cut at the next example): greedy 0.21, sampled Pass@1 0.125,
# Pass@16 0.60 (100 validation problems, T=0.6); no candidate screened reached sampled Pass@1 0.15
GEMMA3_TASK = "add:digits=1,terms=3,shots=8,test=250,validation=250"
MODELS = {
    "tiny": {"task": "arith", "preset": "tiny"},
    "smollm2": {"task": SMOLLM2_TASK, "preset": "smollm2"},
    "qwen2.5-0.5b": {"task": QWEN05_TASK, "preset": "qwen2.5"},
    "qwen2.5-1.5b": {"task": QWEN15_TASK, "preset": "qwen2.5"},
    "gemma3-270m": {"task": GEMMA3_TASK},
}
FALLBACK_TASK = "arith"


def default_task(model: str | None) -> str:
    """The task a model is evaluated/trained on when --task is not given: a named model's, a run's own."""
    trained = _run_task(model)
    if trained is not None:
        return trained
    return MODELS.get(str(model or "tiny"), {}).get("task", FALLBACK_TASK)


def _run_task(model) -> str | None:
    """The task spec in the config.json of the run directory `model` is (or whose checkpoints/NAME it is);
    None for anything else. Evaluating a run on `arith` because its path is no named model gave SmolLM2 runs
    Pass@1 ~0 on a task they never saw."""
    if model is None or not isinstance(model, (str, os.PathLike)):
        return None
    path = Path(model)
    for run in (path, path.parent.parent if path.parent.name == "checkpoints" else None):
        cfg = None if run is None else run / "config.json"
        if cfg is None or not cfg.is_file():
            continue
        try:
            doc = json.loads(cfg.read_text())
        except (OSError, ValueError):
            return None
        if isinstance(doc, dict) and "method" in doc and isinstance(doc.get("task"), str):
            return doc["task"]
    return None


def auto_preset(model: str | None) -> str:
    """The preset `auto` stands for: the model's own where it has one, else the paper's settings."""
    return MODELS.get(str(model or "tiny"), {}).get("preset", "paper")
