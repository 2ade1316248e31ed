"""The study's up-front plan counts what will run (issue #31): every temperature, the --population-sizes and
--two-point runs and the held-out tasks, as the study's own plan (`run_plan`, `study_tasks`) has them."""

from __future__ import annotations

import re

from cli.study import _plan
from deltalens.study.config import StudyConfig
from deltalens.study.plan import study_tasks
from deltalens.study.runs import run_plan


def _models(line: str) -> int:
    return int(re.search(r": ([\d,]+) models? x ", line).group(1).replace(",", ""))


def test_plan_counts_every_run_temperature_and_task(tmp_path):
    cfg = StudyConfig.resolve(given={"model": "tiny", "limit": 10, "temperatures": "0.6,1.0",
                                     "population_sizes": "4,8", "two_point": True, "held_out": "arith-3"})
    runs = run_plan(cfg, tmp_path)
    keys = [t.key for t in study_tasks(cfg, runs)]
    lines = _plan(cfg, tmp_path)
    by = {line.split(" (")[0].split(":")[0]: line for line in lines}
    assert by["study training"].startswith(f"study training: {len(runs)} runs (es, grpo, es-grpo, es-n4, es-n8")
    assert "es-2pt; 3 seeds each" in by["study training"]
    # 2 temperatures x (3 base seeds + every run, the extra ES runs included): 18 was said before for 76 evaluations
    passk = _models(by["study Pass@K"])
    assert passk == sum(k.startswith("eval:") for k in keys) == 2 * (3 + len(runs))
    assert len(runs) > 3 * 3 and passk > 3 + 9
    assert "at 2 temperatures" in by["study Pass@K"]
    assert _models(by["study sparsity"]) == 1 + 2 * (1 + 3 * 3)  # the base; es-s0, grpo-s0: full + 3 x 3 points
    held = next(x for x in lines if x.startswith("study held-out arith-3"))
    assert _models(held) == sum(k.startswith("heldout:arith-3:") for k in keys) == 1 + len(runs)


def test_plan_is_empty_when_the_study_cannot_plan(tmp_path):
    cfg = StudyConfig.resolve(given={"model": "tiny", "task": "nope"})
    assert _plan(cfg, tmp_path) == []
