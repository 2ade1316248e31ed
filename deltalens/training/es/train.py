"""The ES training loop: iterations through a member backend, metrics, checkpoints, exact resume.

Per iteration: the P prompts of (seed, iteration); every member's reward from the backend (local, Ray
or vLLM: `deltalens.training.es.backends`); shaped fitness z; the update θ += (α/N) Σ z_i ε_i applied
by the backend on every replica; one metrics row (rewards, fitness, seeds, update RMS, weights
checksum, timings); a checkpoint every `checkpoint_every` iterations and at the end (with `keep_checkpoints`
off, each one replaces the one before: `RunDir.prune`). With `report_to`,
each row is mirrored to TensorBoard / W&B in the run directory (`deltalens.training.tracking`: reward
mean/std, the members' rewards as a histogram, the update's RMS and norm, validation Pass@1, timings).

Compute dtype: `compute_dtype` auto is resolved once, when the run starts (`es_compute_dtype`), and the
result is recorded in every metrics row and in state.json (`compute_dtype`: "fp32", "bf16", ...); a
resume generates in the recorded dtype, so the trajectory does not depend on the machine it resumes
on. A run from before the option has none recorded: it generated in its weight dtype, and resumes so.

Exact resume: the state of a run is (seed, step) plus the weights (evosax style), so a checkpoint and
its checksum resume a killed run bit-identically; settings that decide the trajectory may not change.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deltalens.errors import DeltalensError
from deltalens.generation.dtype import machine
from deltalens.io.models import load_model
from deltalens.io.runs import RunDir, checkpoint_name
from deltalens.training.budget import es_units
from deltalens.training.es.backends import make_member_evaluator
from deltalens.training.es.config import ESConfig
from deltalens.training.es.engine import ESEngine
from deltalens.training.es.strategy import fitness_shaping, iteration_problems
from deltalens.training.run import held_out_pass_at_1, make_task, open_run, run_config
from deltalens.training.tracking import Tracker, require


@dataclass
class ESState:
    """Everything besides the weights that a resume needs: the run seed and the completed step."""

    seed: int
    step: int  # iterations completed (= updates applied)
    checksum: str | None = None  # weights checksum after `step` (verified on resume)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"method": "es", "iteration": self.step, "seed": self.seed, "checksum": self.checksum, **self.extra}


def _held_out(engine: ESEngine) -> dict:
    return held_out_pass_at_1(engine.model, engine.tok, engine.task, limit=engine.config.eval_limit,
                              max_new_tokens=engine.max_new_tokens, backend=engine.generator)


def train_es(config: ESConfig, out: str | Path, resume: bool = False,
             progress: Callable[[int, int, dict | None], None] | None = None, *,
             overwrite: bool = False, backend_options: dict | None = None) -> Path:
    """Run (or resume) ES training into the run directory `out`; returns its path.

    progress(done, total, row) is called once before the first iteration (row None) and after every
    iteration with its metrics row. With `resume`, the run continues from its last checkpoint and ends
    bit-identical to an uninterrupted run; only non-trajectory settings (iterations, eval/checkpoint
    cadence, backend, workers) may differ from the stored config. `backend_options` go to the backend
    (tests use {"fail_at": (iteration, member)} to kill a Ray worker).
    """
    # everything that can be refused is refused before the run directory is created or touched
    require(config.report_to)  # a missing tracker package
    run = RunDir(out)
    task = make_task(config)
    engine = None
    if not resume:
        run.check_create(overwrite)
        model, tok = load_model(config.model, dtype=config.dtype, device=config.device)
        engine = ESEngine(model, tok, task, config)  # checks the parameter filter against the model
    try:
        with run.writing():  # one writer at a time; stale temporaries of a killed writer are removed
            return _train(run, config, task, engine, resume, progress, overwrite, backend_options)
    finally:
        if engine is not None:
            engine.close()  # idempotent; _train closes the engine it trains with


def _train(run: RunDir, config: ESConfig, task, engine: ESEngine | None, resume: bool, progress,
           overwrite: bool, backend_options: dict | None) -> Path:
    """train_es under the run's writer lock; `engine`: a new run's, built from its starting model."""
    state = open_run(run, config, resume=resume, overwrite=overwrite, reopen_final=True)

    start = state["iteration"] if state else 0
    model_spec = str(run.latest()) if start > 0 else config.model
    run.truncate_metrics(start if start > 0 else -1)
    if start == config.iterations:
        return run.path

    if engine is None:  # a resume: the engine starts from the latest checkpoint, in the run's compute dtype
        model, tok = load_model(model_spec, dtype=config.dtype, device=config.device)
        pinned = (state.get("compute_dtype") or "fp32") if state and start > 0 else None
        engine = ESEngine(model, tok, task, config, compute_dtype=pinned)
    if state and state.get("checksum") and start > 0 and engine.checksum() != state["checksum"]:
        raise DeltalensError(f"checkpoint {model_spec} does not match the checksum in state.json; "
                             "it was modified or is corrupt: restore it or start a new run")
    backend = make_member_evaluator(config, engine, model_spec, backend_options)
    try:
        with Tracker(run.path, config.report_to, start=start, config=run_config(config)) as tracker:
            _loop(run, config, engine, backend, start, progress, tracker)
    finally:
        backend.close()
        engine.close()
    return run.path


def _loop(run: RunDir, config: ESConfig, engine: ESEngine, backend, start: int, progress, tracker: Tracker) -> None:
    """Iterations start+1..config.iterations: a metrics row (mirrored to the trackers) and checkpoints each."""
    model, tok = engine.model, engine.tok
    norm = math.sqrt(engine.n_trained)  # update_rms -> ‖Δθ‖ of the update
    if start == 0 and config.eval_every:
        row = {"iteration": 0, "eval": _held_out(engine)}
        run.log(row)
        tracker.log_row(row)
    if progress:
        progress(start, config.iterations, None)
    for it in range(start + 1, config.iterations + 1):
        row = _iteration(engine, backend, it)
        if config.eval_every and (it % config.eval_every == 0 or it == config.iterations):
            row["eval"] = _held_out(engine)
        run.log(row)
        tracker.log_row(row, extra={"train/update_norm": row["update_rms"] * norm,
                                    "train/units": es_units(it, config.prompts_per_iteration, config.population)})
        st = ESState(config.seed, it, row["checksum"], {"compute_dtype": engine.compute_dtype})
        name = "final" if it == config.iterations else (
            checkpoint_name(it) if config.checkpoint_every and it % config.checkpoint_every == 0 else None)
        if name is not None:
            run.save(model, tok, name, st.to_dict(), save_pt=config.save_pt, prune=not config.keep_checkpoints)
        if progress:
            progress(it, config.iterations, row)


def _iteration(engine: ESEngine, backend, it: int) -> dict:
    """One ES iteration through `backend`; returns the metrics row."""
    cfg = engine.config
    t0 = time.perf_counter()
    problems = iteration_problems(engine.task, cfg, it)
    rewards, timing = backend.evaluate(it, problems)
    z = fitness_shaping(rewards, cfg.fitness)
    upd = backend.update(it, z)
    n = len(rewards)
    mean = sum(rewards) / n
    timing.update({k: upd[k] for k in ("update_s", "update_noise_s", "checksum_s")})
    timing["iteration_s"] = time.perf_counter() - t0
    tokens, count = timing.pop("completion_tokens", 0), timing.pop("completions", 0)
    return {
        "iteration": it,
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "reward_min": min(rewards),
        "reward_max": max(rewards),
        "rewards": rewards,
        "fitness": z,
        "seeds": engine.member_seeds(it),
        "update_rms": upd["update_rms"],
        "checksum": upd["checksum"],
        "compute_dtype": engine.compute_dtype,
        "machine": machine(next(engine.model.parameters()).device),  # this process's (`dtype.machine`)
        "completion_length": tokens / count if count else None,  # mean tokens per member completion
        "timing": {k: round(v, 4) for k, v in timing.items()},
        **({"workers": upd["workers"]} if "workers" in upd else {}),
    }
