"""A study's training task: bring one run of the plan to its budget.

`train_run(ctx, cfg, label)` re-derives the run from the plan (`deltalens.study.runs.run_plan`, under the
study directory as this worker sees it: a chain's stages point at their own directories there) and trains
it unless finished (`deltalens.training.launch.train_unless_finished`): a new run starts, a killed one
resumes from its last checkpoint, a finished one is left alone once its config.json shows it was trained
with the planned settings (`deltalens.training.run.check_finished`; else refused in one line). Its result is small: the run's label,
directory (relative to the study) and total iterations/steps.
"""

from __future__ import annotations

import functools

from deltalens.methods import chain_stages
from deltalens.study.config import StudyConfig
from deltalens.study.executor import TaskContext
from deltalens.study.runs import run_plan, study_budget
from deltalens.training import methods
from deltalens.training.chain import check_finished_chain, train_chain
from deltalens.training.launch import train_unless_finished
from deltalens.training.run import check_finished


def train_run(ctx: TaskContext, cfg: StudyConfig, label: str) -> dict:
    """Train (or resume) the plan's run `label`; returns {"label", "dir", "total"}. A finished run is
    reused only when it was trained with the planned settings (`training.run.check_finished`)."""
    r = next(x for x in run_plan(cfg, ctx.root) if x["label"] == label)
    stages = chain_stages(r["method"])
    if stages is None:
        fn = functools.partial(methods.get(r["method"]).train, r["configs"][r["method"]], r["dir"])
        check = functools.partial(check_finished, r["dir"], r["configs"][r["method"]])
    else:
        fn = functools.partial(train_chain, r["dir"], list(stages), model=cfg.model, task=cfg.task,
                               budget=study_budget(cfg), configs=r["configs"])
        check = functools.partial(check_finished_chain, r["dir"], list(stages), cfg.model, cfg.task, r["configs"],
                                  study_budget(cfg))
    train_unless_finished(r["dir"], r["total"], r["label"], fn, log=ctx.log, progress_factory=ctx.progress,
                          check_finished=check)
    return {"label": label, "dir": f"runs/{label}", "total": r["total"]}
