"""Experiment tracking: `--report-to tensorboard|wandb|none` (comma-separated for both, as TRL's `report_to`).

metrics.jsonl stays the run's record; a tracker mirrors each of its rows, as it is written, to TensorBoard
and/or Weights & Biases, inside the run directory:

    RUN/tensorboard/     TensorBoard event files (`tensorboard --logdir RUN`; needs `deltalens[tensorboard]`)
    RUN/wandb/           W&B's run directories (`wandb.init(dir=RUN)`; needs `deltalens[wandb]`): offline
                         unless WANDB_MODE is set (then W&B does what it says), so nothing leaves the machine
                         by default; `wandb sync RUN/wandb/offline-run-*` uploads one later

One scheme of names serves ES and GRPO, so their curves overlay (the x axis is the run's iteration/step):

    train/reward, train/reward_std   mean and spread of the step's rewards (ES: over the members'
                                     rewards; GRPO: TRL's own values, over all completions)
    train/reward_min, train/reward_max, train/units (compute units so far, `deltalens.training.budget`)
    train/rewards                    histogram of those rewards (ES: one per member; GRPO: one per completion)
    eval/pass_at_1, eval/mean_reward held-out greedy Pass@1 when the run evaluates (step 0 = before training)
    time/iteration_s, time/eval_s    wall seconds of the iteration/step and of the evaluation
    ES only     train/update_rms, train/update_norm (‖Δθ‖ of the update), time/<phase>_s (generation,
                noise, perturb_restore, update, checksum, ...)
    GRPO only   every number TRL logs, under the name TRL's own report_to gives it (`train/<key>`:
                train/kl, train/entropy, train/loss, train/grad_norm, train/learning_rate,
                train/completions/mean_length, train/clip_ratio/region_mean, ...)

GRPO does not hand `report_to` to TRL (its TrainingArguments keep `report_to="none"`): TRL's callbacks count
steps from 0 in every process, so a resumed run would log its steps again from 1, and its W&B callback
picks its own directory and mode. The run's callback logs TRL's numbers through this module instead, at the
run's step, under the same `train/` names.

Resume: the rows after the last checkpoint are redone (bit-identically). TensorBoard is told so (the new
writer's `purge_step`): events at or after the first redone step are hidden, so every step shows once. W&B
keeps its run id in RUN/wandb/deltalens-run-id and resumes that run (`resume="allow"`): online, W&B drops
the redone steps it already has; offline, each process writes its own offline-run directory with the
same id. `--overwrite` removes both directories with the old run (`RunDir.create`). A chain logs each
stage in its own stage run (RUN/es/tensorboard, RUN/grpo/tensorboard, each from step 1); a study or a
sweep logs each of its runs in that run's directory.

A missing package is refused, one line, before any work (`require`); `report_to` is not a trajectory
setting (a resume may turn it on or off). This module imports no tracker (nor torch) until a run opens one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from deltalens.errors import DeltalensError
from deltalens.io.atomic import atomic_path
from deltalens.io.runs import TENSORBOARD_DIR, WANDB_DIR

TARGETS = ("tensorboard", "wandb")
WANDB_ID_FILE = "deltalens-run-id"
HELP = "experiment trackers: none, tensorboard, wandb (offline unless WANDB_MODE is set), or tensorboard,wandb"


def normalize_report_to(value) -> str:
    """The canonical form of a `report_to` value: 'none', or tracker names joined by ',' (duplicates dropped);
    anything else is a one-line error."""
    if not isinstance(value, str):
        raise DeltalensError(f"--report-to must be none, tensorboard, wandb or a comma-separated list (got "
                             f"{type(value).__name__})")
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in (*TARGETS, "none")]
    if not names or bad or ("none" in names and len(names) > 1):
        shown = value if len(value) <= 60 else value[:57] + "..."
        raise DeltalensError(f"--report-to must be none, tensorboard, wandb or tensorboard,wandb (got {shown!r})")
    return "none" if names == ["none"] else ",".join(dict.fromkeys(names))


def targets(report_to: str) -> tuple[str, ...]:
    """The trackers a (normalized or raw) `report_to` value names: () for none."""
    value = normalize_report_to(report_to)
    return () if value == "none" else tuple(value.split(","))


def require(report_to: str) -> None:
    """Refuse (one line) a `report_to` whose tracker package is not installed. Call before any work."""
    for name in targets(report_to):
        if importlib.util.find_spec(name) is None:
            raise DeltalensError(f"--report-to {name} needs `pip install 'deltalens[{name}]'`")


def _num(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def row_metrics(row: Mapping) -> dict[str, float]:
    """The scalars of one metrics.jsonl row (ES or GRPO) under the shared names (module docstring)."""
    out: dict[str, float] = {}
    for key, value in (row.get("trl") or {}).items():  # GRPO: TRL's numbers, named as TRL's report_to names them
        if _num(value) is not None:
            name = "eval/" + key[5:] if key.startswith("eval_") else "train/" + key
            out[name] = _num(value)
    for key, name in (("reward_mean", "train/reward"), ("reward_std", "train/reward_std"),
                      ("reward_min", "train/reward_min"), ("reward_max", "train/reward_max"),
                      ("frac_correct", "train/frac_correct"), ("units", "train/units"),
                      ("update_rms", "train/update_rms")):
        if _num(row.get(key)) is not None:
            out.setdefault(name, _num(row[key]))  # TRL's own value wins where it has one
    for key, value in (row.get("timing") or {}).items():
        if _num(value) is not None:
            out["time/" + key] = _num(value)
    ev = row.get("eval")
    if isinstance(ev, Mapping):
        for key in ("pass_at_1", "mean_reward"):
            if _num(ev.get(key)) is not None:
                out["eval/" + key] = _num(ev[key])
        if _num(ev.get("eval_s")) is not None:
            out["time/eval_s"] = _num(ev["eval_s"])
    return out


class Tracker:
    """The trackers of one run directory (none, TensorBoard, W&B), opened at `start` (the completed step a
    resume continues from; rows after it are logged again). A context manager; `log_row` per metrics row."""

    def __init__(self, run_dir: str | os.PathLike, report_to: str = "none", *, start: int = 0,
                 config: dict | None = None):
        self.path = Path(run_dir)
        self.names = targets(report_to)
        self.tb = None
        self.wandb = None
        try:
            if "tensorboard" in self.names:
                self._open_tensorboard(start)
            if "wandb" in self.names:
                self._open_wandb(config)
        except BaseException:
            self.close(failed=True)
            raise

    def _open_tensorboard(self, start: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise DeltalensError("--report-to tensorboard needs `pip install 'deltalens[tensorboard]'`") from None
        log_dir = self.path / TENSORBOARD_DIR
        # events of steps about to be redone (a resume) are hidden behind the new writer's purge step
        earlier = log_dir.is_dir() and any(log_dir.iterdir())
        purge = (start + 1 if start > 0 else 0) if earlier else None
        self.tb = SummaryWriter(log_dir=str(log_dir), purge_step=purge, flush_secs=30)

    def _open_wandb(self, config: dict | None) -> None:
        try:
            import wandb
        except ImportError:
            raise DeltalensError("--report-to wandb needs `pip install 'deltalens[wandb]'`") from None
        (self.path / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        id_file = self.path / WANDB_DIR / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(4)
            with atomic_path(id_file) as tmp:
                Path(tmp).write_text(run_id + "\n")
        # the user's WANDB_MODE wins; passed explicitly, since W&B reads its environment once per process
        mode = os.environ.get("WANDB_MODE") or "offline"
        self.wandb = wandb.init(dir=str(self.path), mode=mode, id=run_id, resume="allow",
                                project=os.environ.get("WANDB_PROJECT") or "deltalens",
                                name=os.environ.get("WANDB_NAME") or self.path.resolve().name,
                                config=config or {}, settings=wandb.Settings(console="off"))

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.close(failed=kind is not None)

    @property
    def active(self) -> bool:
        return self.tb is not None or self.wandb is not None

    def log(self, step: int, scalars: Mapping[str, float], histograms: Mapping[str, Sequence[float]] | None = None
            ) -> None:
        """Scalars and histograms (lists of values) at `step`."""
        hists = {k: [float(x) for x in v] for k, v in (histograms or {}).items() if v}
        if self.tb is not None:
            import numpy as np

            for name, value in scalars.items():
                self.tb.add_scalar(name, value, step)
            for name, values in hists.items():
                self.tb.add_histogram(name, np.asarray(values), step)
            self.tb.flush()
        if self.wandb is not None:
            import wandb

            self.wandb.log({**scalars, **{k: wandb.Histogram(v) for k, v in hists.items()}}, step=step)

    def log_row(self, row: Mapping, *, rewards: Sequence[float] | None = None,
                extra: Mapping[str, float] | None = None) -> None:
        """One metrics.jsonl row at its iteration; `rewards`: the train/rewards histogram (default: the
        row's own per-member "rewards"); `extra`: more scalars."""
        if not self.active:
            return
        rewards = rewards if rewards is not None else row.get("rewards")
        self.log(int(row.get("iteration", 0)), {**row_metrics(row), **(extra or {})},
                 {"train/rewards": rewards} if rewards else None)

    def close(self, failed: bool = False) -> None:
        if self.tb is not None:
            with contextlib.suppress(Exception):
                self.tb.close()
            self.tb = None
        if self.wandb is not None:
            run, self.wandb = self.wandb, None
            run.finish(exit_code=1 if failed else 0)
