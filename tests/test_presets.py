"""Per-model defaults (`deltalens.presets`): every named model's default task builds, holds a test split a
report can rest on (>= 200 problems) and a validation split to tune on, and its presets exist for both
methods; a name the table does not know gets the fallback task and the paper's settings; a run directory
(or a checkpoint in one) gets the task it was trained on."""

from __future__ import annotations

import pytest

from deltalens import presets
from deltalens.io import wheel_models as wm
from deltalens.tasks import get_task
from deltalens.training.es.config import ESConfig
from deltalens.training.grpo.config import GRPOConfig
from deltalens.training.run import trajectory_diff


@pytest.mark.parametrize("name", sorted(presets.MODELS))
def test_every_default_task_builds_with_splits_to_report_and_tune_on(name):
    assert name in {"tiny", "smollm2", *wm.MODELS}, f"{name} is not a model name deltalens resolves"
    task = get_task(presets.default_task(name))
    test, val = task.test(), task.validation()
    assert len(test) >= 200 and len(val) >= 100
    assert not {p.prompt for p in test} & {p.prompt for p in val}  # the splits are disjoint
    preset = presets.auto_preset(name)
    assert preset in ESConfig.PRESETS and preset in GRPOConfig.PRESETS


def test_named_models_get_the_tasks_chosen_for_them():
    # chosen on validation (docs/tuning.md): Qwen2.5-0.5B solves 1-2 digit pairs (greedy 0.92), so it gets 3 terms
    assert presets.default_task("qwen2.5-0.5b") == "add:digits=1-2,terms=3,shots=2"
    assert get_task(presets.default_task("qwen2.5-0.5b")).terms == 3
    # Gemma (a base model) gets plain 8-shot prompts of 1-digit triples, cut before the next example
    gemma = get_task(presets.default_task("gemma3-270m"))
    assert (gemma.digits, gemma.terms, gemma.shots) == ((1, 1), 3, 8)
    assert gemma.stop_strings(chat=False) == ("\n\nQ:",)
    assert presets.auto_preset("gemma3-270m") == "paper"
    # the 1.5B solves the 0.5B's task (greedy 0.83): a fourth term of 2 digits brings it into the band
    assert presets.default_task("qwen2.5-1.5b") == "add:digits=2,terms=4,shots=2"
    assert presets.auto_preset("qwen2.5-1.5b") == "qwen2.5"
    # ES's qwen2.5 preset is smollm2's scaled to Qwen's ~13x smaller weights (docs/tuning.md)
    assert presets.auto_preset("qwen2.5-0.5b") == "qwen2.5"
    qwen, smol = ESConfig.PRESETS["qwen2.5"], ESConfig.PRESETS["smollm2"]
    assert qwen["sigma"] < smol["sigma"] / 10 and {k: v for k, v in qwen.items() if k not in ("sigma", "alpha")} == {
        k: v for k, v in smol.items() if k not in ("sigma", "alpha")}
    # GRPO's qwen2.5 preset is smollm2's with the lr scaled the same way (1e-5 collapsed Qwen in one step)
    gq, gs = GRPOConfig.PRESETS["qwen2.5"], GRPOConfig.PRESETS["smollm2"]
    assert (gq["learning_rate"], gs["learning_rate"]) == (1e-6, 1e-5)
    # and recomputes activations in backward (a Qwen2.5-0.5B step peaked at 20.9 GB without, 17.3 GB with):
    # memory only, so a run trained before the change is still the preset's (a study reuses it, a resume too)
    assert gq["gradient_checkpointing"] is True and "gradient_checkpointing" not in gs
    same = ("learning_rate", "gradient_checkpointing")
    assert {k: v for k, v in gq.items() if k not in same} == {k: v for k, v in gs.items() if k not in same}
    before = GRPOConfig.preset("qwen2.5", gradient_checkpointing=False)
    assert trajectory_diff(before, GRPOConfig.preset("qwen2.5")) == []
    assert presets.default_task("some/hub-id") == "arith" and presets.default_task(None) == "arith"


def test_a_run_directory_defaults_to_the_task_it_trained_on(tmp_path):
    import json

    run = tmp_path / "run"
    (run / "checkpoints" / "final").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"method": "es", "model": "smollm2", "task": "add:digits=3"}))
    (run / "checkpoints" / "final" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert presets.default_task(str(run)) == "add:digits=3"
    assert presets.default_task(run / "checkpoints" / "final") == "add:digits=3"  # a checkpoint of the run
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "task": "not ours"}))
    assert presets.default_task(str(hf)) == "arith"  # an HF directory is no run: the fallback
    (run / "config.json").write_text("{not json")
    assert presets.default_task(str(run)) == "arith"
