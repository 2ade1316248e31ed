"""Per-model defaults: the task and the hyperparameter preset a model spec gets when none is given.

    tiny      task `arith` (what it was SFT'd on), presets `tiny` (ESConfig / GRPOConfig.PRESETS)
    smollm2   task SMOLLM2_TASK, presets `smollm2`; chosen on validation problems only
              (docs/tuning.md: "SmolLM2-135M-Instruct")
    qwen2.5-0.5b
              task QWEN05_TASK, chosen on validation problems only (docs/tuning.md: "Qwen2.5-Coder-0.5B-Instruct
              and Gemma-3-270M"); presets `paper` (not tuned for it yet). gemma3-270m has none yet: its
              best candidate is at the rule's edge (greedy 0.13-0.16) and loads worse under the vLLM
              venv's transformers 5.19 (same docs section)
    anything else: no default task (`arith` is used), presets `paper` (the paper's settings)

`deltalens eval`, `probe` and `train` use these when --task / --preset are not given; an explicit option
always wins. Torch-free.
"""

from __future__ import annotations

SMOLLM2_TASK = "add:digits=1-2,terms=2,shots=2"  # base Pass@1 ~0.35, Pass@16 ~0.54 (validation)
# Qwen2.5-Coder-0.5B-Instruct: greedy 0.54, sampled Pass@1 0.41, Pass@16 0.96 (24 validation problems, T=0.6);
# SmolLM2's 1-2 digit pairs are too easy for it (greedy 0.92)
QWEN05_TASK = "add:digits=1-2,terms=3,shots=2"
MODELS = {
    "tiny": {"task": "arith", "preset": "tiny"},
    "smollm2": {"task": SMOLLM2_TASK, "preset": "smollm2"},
    "qwen2.5-0.5b": {"task": QWEN05_TASK, "preset": "paper"},
}
FALLBACK_TASK = "arith"


def default_task(model: str | None) -> str:
    """The task a model is evaluated/trained on when --task is not given."""
    return MODELS.get(str(model or "tiny"), {}).get("task", FALLBACK_TASK)


def auto_preset(model: str | None) -> str:
    """The preset `auto` stands for: the model's own where it has one, else the paper's settings."""
    return MODELS.get(str(model or "tiny"), {}).get("preset", "paper")
