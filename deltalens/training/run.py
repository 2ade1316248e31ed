"""Run plumbing shared by every trainer (ES, GRPO; chains build on both).

- `make_task(config)`: the task a config names (task, data, question/answer fields), data checked.
- `run_config(config)`: the run's config.json (options in use + record fields; `deltalens.config`).
- `open_run(run, config, resume=...)`: create the run directory, or re-open it for an exact resume
  after checking that no setting that decides the trajectory changed; returns the resume state. The
  caller holds the run's writer lock (`RunDir.writing`) and has validated everything else first.
- `held_out_pass_at_1`: the greedy Pass@1 every method logs on held-out validation problems (the split
  tuning may look at; test problems are for the final evaluation only).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from deltalens import __version__
from deltalens.config import Config
from deltalens.errors import DeltalensError
from deltalens.evaluation import evaluate
from deltalens.io.runs import RunDir
from deltalens.tasks import get_task


def make_task(config):
    """The task of a training config (fields task, data, question_field, answer_field), its data read:
    a trainer calls this before it touches the run directory, so a bad task or data file leaves none."""
    task = get_task(config.task, data=config.data, question_field=config.question_field,
                    answer_field=config.answer_field)
    task.test()
    task.train(1, random.Random(0))  # reads (and checks) a jsonl task's training rows; no shared state
    return task


def run_config(config: Config) -> dict:
    """What config.json holds: the options the config uses (`Config.to_dict(in_use=True)`) and the record
    fields, its method and the deltalens version; the file is a valid `--config` that reproduces the run
    (`Config.run_options`)."""
    return {**config.to_dict(in_use=True), "deltalens_version": __version__}


def trajectory_diff(stored: Config, given: Config) -> list[str]:
    """The fields that decide the trajectory (and the method's resume conflicts) where `given` differs."""
    diff = [f for f in type(given).trajectory_fields() if getattr(stored, f) != getattr(given, f)]
    return diff + [f for f in given.resume_conflicts(stored) if f not in diff]


def check_finished(run_dir: Path, given: Config, skip: tuple[str, ...] = ()) -> None:
    """A finished run that a study or sweep reuses as `given` instead of training it: refuse (one line) when it
    was trained with another value of a field that decides the trajectory (a preset changed since it ran, a
    run directory brought from elsewhere). `skip`: fields not compared (a chain stage's path to the stage
    before it, which moves with the study directory)."""
    run = RunDir(run_dir)
    stored = type(given).from_dict(run.config(), source=str(run.path / "config.json"))
    diff = [f for f in trajectory_diff(stored, given) if f not in skip]
    if diff:
        pairs = ", ".join(f"{f}: run has {getattr(stored, f)!r}, planned {getattr(given, f)!r}" for f in diff)
        raise DeltalensError(f"{run_dir} is finished but was trained with other settings than planned ({pairs}); "
                             "move it away to train it again, or use another --out")


def check_resume(stored: Config, given: Config, run_dir: Path) -> None:
    """Refuse to resume with a different value of any field that decides the trajectory."""
    diff = trajectory_diff(stored, given)
    if diff:
        pairs = ", ".join(f"{f}: run has {getattr(stored, f)!r}, given {getattr(given, f)!r}" for f in diff)
        raise DeltalensError(f"cannot resume {run_dir} with different settings ({pairs}); "
                             "resume with the run's settings or start a new run with --out")


def open_run(run: RunDir, config: Config, *, resume: bool, overwrite: bool = False, write: bool = True,
             reopen_final: bool = False) -> dict | None:
    """Create the run (refusing to clobber one unless `overwrite`), or re-open it for a resume.

    Returns the resume state (state.json) when there is a checkpoint to continue from, else None.
    `write`: this process writes the run directory (rank 0 of a multi-process run). `reopen_final`:
    growing a finished run first turns `final` back into an iter-N checkpoint (RunDir.reopen_final).
    """
    count = type(config).COUNT
    if not resume:
        if write:
            run.create(run_config(config), overwrite=overwrite)
        return None
    if not (run.path / "config.json").exists():
        raise DeltalensError(f"nothing to resume in {run.path} (no config.json); drop --resume to start a run")
    check_resume(type(config).from_dict(run.config(), source=str(run.path / "config.json")), config, run.path)
    state = run.state() if run.latest() is not None else None
    total = getattr(config, count)
    if state and state["iteration"] > total:
        raise DeltalensError(f"{run.path} already has {state['iteration']} {count}; "
                             f"pass --{count} {state['iteration']} or more")
    if reopen_final and state and state["checkpoint"] == "final" and state["iteration"] < total:
        state = run.reopen_final(state)  # growing a finished run: `final` must not name old weights
    if write:
        run.write_config(run_config(config))
    return state


def held_out_pass_at_1(model, tok, task, *, limit: int, max_new_tokens: int, backend) -> dict:
    """Greedy Pass@1 (one response, temperature 0) on the first `limit` validation problems, in eval mode."""
    was_training = model.training if model is not None else False
    if model is not None:
        model.eval()
    t0 = time.perf_counter()
    try:
        r = evaluate(model, tok, task, samples=1, ks=[1], temperature=0.0, limit=limit,
                     max_new_tokens=max_new_tokens, backend=backend, split="validation")
    finally:
        if model is not None:
            model.train(was_training)
    return {"pass_at_1": r["pass_at_k"]["1"], "mean_reward": r["mean_reward"], "n_problems": r["n_problems"],
            "eval_s": round(time.perf_counter() - t0, 3)}
