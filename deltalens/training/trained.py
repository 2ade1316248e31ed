"""The problems a run trained on, regenerated from its config (prompts are functions of (seed, iteration);
nothing is stored): `deltalens eval MODEL --trained-on RUN` scores models on them, the fair way to ask
"did training reward rise" (per-iteration rewards are over different prompts each time).

    task, problems = trained_problems("runs/es")   # ES: every iteration's P prompts, up to its last checkpoint
"""

from __future__ import annotations

from pathlib import Path

from deltalens.errors import DeltalensError
from deltalens.io.runs import RunDir
from deltalens.tasks import Task, get_task
from deltalens.training import methods


def _done(run: RunDir) -> int:
    """Iterations/steps behind the run's weights (its final checkpoint, else its latest iter-N)."""
    cks = run.checkpoints()
    if not cks:
        raise DeltalensError(f"{run.path} has no checkpoint yet: it has trained on nothing that can be scored")
    return max(cks)


def trained_problems(run_dir: str | Path) -> tuple[Task, list]:
    """(the run's task, the problems of every iteration/step up to its weights, in training order).
    A chain gives its stages' problems in stage order; repeats are kept (a prompt drawn twice counts twice).
    Each method regenerates its own (`Method.problems`)."""
    run = RunDir(run_dir)
    if not (run.path / "config.json").is_file():
        raise DeltalensError(f"--trained-on {run_dir}: not a run directory (no config.json)")
    cfg = run.config()
    m = methods.find(cfg.get("method"))
    if m is not None and "stages" not in cfg:  # a one-stage chain says "es" too
        c = m.config.from_dict(cfg, source=str(run.path / "config.json"))
        task = get_task(c.task, data=c.data, question_field=c.question_field, answer_field=c.answer_field)
        return task, m.problems(task, c, _done(run))
    stages = cfg.get("stages")
    if not isinstance(stages, list) or not stages:
        raise DeltalensError(f"--trained-on {run_dir}: {run.path / 'config.json'} names no deltalens training method")
    task, problems = None, []
    for st in stages:
        d = run.path / str(st.get("dir"))
        if not (d / "config.json").is_file() or not RunDir(d).checkpoints():
            break  # a killed chain: this stage has not saved anything yet
        task, more = trained_problems(d)
        problems += more
    if task is None:
        raise DeltalensError(f"{run.path} has no checkpoint yet: it has trained on nothing that can be scored")
    return task, problems
