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


def _done(run: RunDir) -> int:
    """Iterations/steps behind the run's weights (its final checkpoint, else its latest iter-N)."""
    cks = run.checkpoints()
    if not cks:
        raise DeltalensError(f"{run.path} has no checkpoint yet: it has trained on nothing that can be scored")
    return max(cks)


def trained_problems(run_dir: str | Path) -> tuple[Task, list]:
    """(the run's task, the problems of every iteration/step up to its weights, in training order).
    A chain gives its stages' problems in stage order; repeats are kept (a prompt drawn twice counts twice)."""
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.strategy import iteration_problems
    from deltalens.training.grpo.config import GRPOConfig
    from deltalens.training.grpo.train import run_problems

    run = RunDir(run_dir)
    if not (run.path / "config.json").is_file():
        raise DeltalensError(f"--trained-on {run_dir}: not a run directory (no config.json)")
    cfg = run.config()
    method = cfg.get("method")
    if method in ("es", "grpo"):
        cls = ESConfig if method == "es" else GRPOConfig
        c = cls.from_dict(cfg, source=str(run.path / "config.json"))
        task = get_task(c.task, data=c.data, question_field=c.question_field, answer_field=c.answer_field)
        done = _done(run)
        if method == "es":
            problems = [p for it in range(1, done + 1) for p in iteration_problems(task, c, it)]
        else:
            problems = run_problems(task, c, 1, done)
        return task, problems
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
