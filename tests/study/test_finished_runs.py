"""A study reuses a finished run only when its config.json shows the planned settings
(`deltalens.training.run.check_finished`): a run trained under an older preset, or brought from another study
with other settings, is refused in one line instead of being analysed as what the plan says."""

from __future__ import annotations

import json
import shutil

import pytest
from support import tiny_spec

from deltalens.errors import DeltalensError
from deltalens.study.config import StudyConfig
from deltalens.study.executor import TaskContext
from deltalens.study.train import train_run


def _study(root, methods):
    cfg = StudyConfig(model=tiny_spec(), task="arith", methods=methods, seeds=(0,), budget=8192, limit=2, samples=2,
                      k=(1, 2))
    return cfg, TaskContext(root=root, deps={}, log=lambda s: None)


def _edit(path, **values):
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, **values}))


def test_a_finished_run_with_other_settings_is_refused(tmp_path):
    cfg, ctx = _study(tmp_path, ("es",))
    train_run(ctx, cfg, "es-s0")
    run = tmp_path / "runs" / "es-s0"
    metrics = (run / "metrics.jsonl").read_bytes()
    train_run(ctx, cfg, "es-s0")  # finished with the planned settings: reused, nothing trained
    assert (run / "metrics.jsonl").read_bytes() == metrics
    planned = json.loads((run / "config.json").read_text())["sigma"]
    _edit(run / "config.json", sigma=0.01)  # as if trained under an older preset
    with pytest.raises(DeltalensError) as e:
        train_run(ctx, cfg, "es-s0")
    assert str(e.value) == (f"{run} is finished but was trained with other settings than planned (sigma: run has "
                            f"0.01, planned {planned!r}); move it away to train it again, or use another --out")
    _edit(run / "config.json", eval_every=3, sigma=planned)  # a setting that does not decide the trajectory
    train_run(ctx, cfg, "es-s0")


def test_a_finished_chain_is_checked_stage_by_stage_and_may_move(tmp_path):
    cfg, ctx = _study(tmp_path / "a", ("es-grpo",))
    train_run(ctx, cfg, "es-grpo-s0")
    shutil.move(tmp_path / "a", tmp_path / "b")  # the stages' absolute paths to each other now point elsewhere
    cfg, ctx = _study(tmp_path / "b", ("es-grpo",))
    train_run(ctx, cfg, "es-grpo-s0")
    stage = tmp_path / "b" / "runs" / "es-grpo-s0" / "grpo"
    _edit(stage / "config.json", learning_rate=0.5)
    with pytest.raises(DeltalensError, match=rf"^{stage} is finished but was trained with other settings than "
                                             r"planned \(learning_rate: run has 0\.5, planned "):
        train_run(ctx, cfg, "es-grpo-s0")


def test_a_sweep_checks_its_finished_runs_too(tmp_path):
    from deltalens.study.sweep import train_task
    from deltalens.training.es.config import ESConfig

    config = ESConfig.preset("tiny", model=tiny_spec(), task="arith", iterations=1, eval_every=0)
    ctx = TaskContext(root=tmp_path, deps={}, log=lambda s: None)
    train_task(ctx, "es", "p0-s0", config, 1, "p0-s0")
    train_task(ctx, "es", "p0-s0", config, 1, "p0-s0")  # finished as planned: reused
    with pytest.raises(DeltalensError, match=r"is finished but was trained with other settings than planned "
                                             r"\(alpha: run has 0\.003, planned 0\.1\)"):
        train_task(ctx, "es", "p0-s0", ESConfig.preset("tiny", model=tiny_spec(), task="arith", iterations=1,
                                                       eval_every=0, alpha=0.1), 1, "p0-s0")
