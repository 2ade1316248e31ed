"""The run directory every training method writes (ES, GRPO, and their chains), and the one place its
layout is known.

    runs/es/
      config.json          the options in use (hyperparameters, model spec, task, seed) and the record fields
                           method and deltalens_version; a valid `--config` (deltalens.config)
      metrics.jsonl        one JSON object per iteration/step (appended, flushed, fsynced)
      state.json           resume state: last completed iteration and the checkpoint it is in
      checkpoints/
        iter-000010/       HF-format directory (model.safetensors + config.json + tokenizer files)
        final/             the last weights, written when the run finishes
        iter-000010.pt     optional plain state dict (--save-pt)
                           (--no-keep-checkpoints: only the checkpoint state.json names is kept, `prune`)
      tensorboard/, wandb/ with --report-to: the trackers' logs (deltalens.training.tracking)

      .lock                held (fcntl.flock) by the one process writing the run; holds its pid

Every file is written atomically (temp file, then rename), so a run killed at any point leaves either
the previous or the new version of each file, never half of one; the temporaries such a kill leaves
are removed the next time the run is opened for writing. A model spec naming a run directory stands
for its `final` checkpoint, else the latest one (`RunDir.weights`).

One writer at a time: a trainer holds `RunDir.writing()` for as long as it writes. The lock is an
flock on `.lock`, which the kernel releases when its holder dies (kill -9 included), so a lock left by
a killed process never blocks a resume, while a live one refuses a second writer with its pid. Failed
reads and writes (a corrupt state.json, a full disk) are one-line DeltalensErrors naming the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import asdict, is_dataclass
from pathlib import Path

from deltalens.errors import DeltalensError
from deltalens.io.atomic import (
    atomic_dir,
    atomic_path,
    clean_stale,
    save_state_dict,
    write_error,
    write_json_atomic,
)
from deltalens.io.quiet import quiet_transformers

_ITER = re.compile(r"iter-(\d+)")
LOCK_NAME = ".lock"
TENSORBOARD_DIR, WANDB_DIR = "tensorboard", "wandb"  # --report-to logs (deltalens.training.tracking)
# what a run directory itself holds (anything else in it, e.g. a report, is not part of the run)
RUN_ENTRIES = ("config.json", "metrics.jsonl", "state.json", "checkpoints", LOCK_NAME, ".trl", TENSORBOARD_DIR,
               WANDB_DIR)


def read_json(path: Path, what: str = "file"):
    """Parse a JSON file of a run; a corrupt one is a one-line error naming it (FileNotFoundError passes)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise DeltalensError(f"{path} is corrupt (not valid JSON: {str(e).splitlines()[0][:120]}); "
                             f"restore the {what} or start a new run") from None
    except OSError as e:
        raise DeltalensError(f"cannot read {path}: {e.strerror or e}") from None


def checkpoint_name(iteration: int) -> str:
    """The directory name of the checkpoint after `iteration` iterations/steps: iter-000010."""
    return f"iter-{iteration:06d}"


class RunDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.ckpt = self.path / "checkpoints"

    # -- what a directory is
    @staticmethod
    def is_run(path: str | os.PathLike) -> bool:
        """A deltalens run directory: config.json and metrics.jsonl (a model directory has no metrics)."""
        p = Path(path)
        return p.is_dir() and (p / "metrics.jsonl").is_file() and (p / "config.json").is_file()

    def method(self) -> str | None:
        """The method the run's config.json names (es, grpo, es-grpo, ...), None if unreadable."""
        try:
            m = json.loads((self.path / "config.json").read_text()).get("method")
        except (OSError, ValueError, AttributeError, RecursionError):
            return None
        return m if isinstance(m, str) else None

    def checkpoints(self) -> dict[int, Path]:
        """iteration -> checkpoint directory of every complete checkpoint (final under its iteration)."""
        found: dict[int, Path] = {}
        if self.ckpt.is_dir():
            for d in self.ckpt.iterdir():
                m = _ITER.fullmatch(d.name)
                if m and (d / "config.json").exists():
                    found[int(m.group(1))] = d
        final = self.ckpt / "final"
        if (final / "config.json").exists():
            st = self.state() or {}
            it = st.get("iteration") if st.get("checkpoint") == "final" else None
            if it is None:
                try:
                    it = self.config().get("iterations", self.config().get("steps"))
                except DeltalensError:
                    it = None
            if isinstance(it, int):
                found.setdefault(it, final)
        return found

    def weights(self) -> Path:
        """The checkpoint the run stands for: checkpoints/final, else the latest iter-N."""
        if (self.ckpt / "final" / "config.json").exists():
            return self.ckpt / "final"
        steps = sorted((int(m.group(1)), d) for d in (self.ckpt.iterdir() if self.ckpt.is_dir() else ())
                       if (m := _ITER.fullmatch(d.name)) and (d / "config.json").exists())
        if not steps:
            raise DeltalensError(f"run directory {self.path} has no checkpoint yet; train longer or pass a checkpoint")
        return steps[-1][1]

    def finished(self, total: int) -> bool:
        """The run reached `total` iterations/steps and wrote its final checkpoint."""
        st = self.state()
        return bool(st) and st.get("checkpoint") == "final" and st.get("iteration") == total and \
            (self.ckpt / "final" / "config.json").exists()

    # -- the writer lock
    @contextlib.contextmanager
    def writing(self) -> Iterator[RunDir]:
        """Hold the run's writer lock for the block (creating the directory if needed).

        Refuses (one line, naming the holder's pid) while another live process holds it. Once held,
        temporaries that a killed writer left (`deltalens.io.atomic.clean_stale`) are removed: under
        the lock they cannot belong to a live writer.
        """
        created = [p for p in (self.path, self.path / LOCK_NAME) if not p.exists()]  # to undo on failure
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise write_error(self.path / LOCK_NAME, e) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                raise DeltalensError(f"{self.path} is being written by another deltalens process (pid {pid}); "
                                     "wait for it to finish or stop it") from None
            try:  # on a full disk even these few bytes fail: refuse now, not at the first checkpoint
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as e:
                err = write_error(self.path / LOCK_NAME, e)
                for made in reversed(created):  # leave behind nothing this call made
                    with contextlib.suppress(OSError):
                        made.rmdir() if made == self.path else made.unlink()
                raise err from None
            for d in (self.path, self.ckpt):
                clean_stale(d)
            (self.path / "metrics.jsonl.tmp").unlink(missing_ok=True)  # older deltalens' temporary
            yield self
        finally:
            os.close(fd)  # releases the lock

    # -- creation / resume
    def check_create(self, overwrite: bool = False) -> None:
        """Refuse a new run here (before any work) if `create` would: the path is a file, already holds a
        run (unless `overwrite`), or holds a config.json that is not a run's (an HF model directory)."""
        if self.path.exists() and not self.path.is_dir():
            raise DeltalensError(f"{self.path} exists and is not a directory; choose another --out")
        if (self.path / "config.json").exists() and not overwrite:
            raise DeltalensError(f"{self.path} already holds a run; pass --resume {self.path} to continue it, "
                                 "or --overwrite / another --out to start afresh")
        if overwrite and (self.path / "config.json").exists():
            try:
                is_run = "method" in json.loads((self.path / "config.json").read_text())
            except (OSError, ValueError, TypeError, RecursionError):
                is_run = False
            if not is_run:  # e.g. an HF model directory: never clobber its config.json
                raise DeltalensError(f"{self.path} holds a config.json that is not a deltalens run's; "
                                     "choose another --out")

    def create(self, config, overwrite: bool = False) -> None:
        """Start a new run; refuses to overwrite an existing run unless `overwrite` (`check_create`)."""
        self.check_create(overwrite)
        if overwrite and (self.path / "config.json").exists():
            # a fresh run: no rows, resume point or checkpoints of the old one may survive
            try:
                (self.path / "metrics.jsonl").unlink(missing_ok=True)
                (self.path / "state.json").unlink(missing_ok=True)
            except OSError as e:
                raise write_error(self.path, e) from None
            for d in (self.ckpt, self.path / TENSORBOARD_DIR, self.path / WANDB_DIR):
                shutil.rmtree(d, ignore_errors=True)
        try:
            self.ckpt.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error(self.ckpt, e) from None
        write_json_atomic(asdict(config) if is_dataclass(config) else config, self.path / "config.json")

    def config(self) -> dict:
        """config.json (one-line errors: missing, corrupt, not an object)."""
        p = self.path / "config.json"
        try:
            cfg = read_json(p, "run's config")
        except FileNotFoundError:
            raise DeltalensError(f"{self.path} is not a run directory (no config.json)") from None
        if not isinstance(cfg, dict):
            raise DeltalensError(f"{p} is corrupt (not a JSON object); restore it or start a new run")
        return cfg

    def write_config(self, config: dict) -> None:
        write_json_atomic(config, self.path / "config.json")

    def state(self) -> dict | None:
        """state.json (None before the first checkpoint); a corrupt one is a one-line error."""
        p = self.path / "state.json"
        try:
            st = read_json(p, "run's state")
        except FileNotFoundError:
            return None
        if not (isinstance(st, dict) and isinstance(st.get("iteration"), int) and
                not isinstance(st.get("iteration"), bool) and isinstance(st.get("checkpoint"), str) and
                Path(st["checkpoint"]).name == st["checkpoint"]):
            raise DeltalensError(f"{p} is corrupt (needs an integer iteration and a checkpoint name); restore "
                                 "it or start a new run")
        return st

    def write_state(self, state: dict) -> None:
        write_json_atomic(state, self.path / "state.json")

    # -- metrics
    def log(self, row: dict) -> None:
        """Append one metrics row (one line of JSON), flushed to disk before returning.

        A failed append (disk full) is a one-line error; a torn last line is ignored by `metrics` and
        dropped on resume (rows after the last checkpoint are redone)."""
        try:
            with open(self.path / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise write_error(self.path / "metrics.jsonl", e) from None

    def metrics(self) -> list[dict]:
        p = self.path / "metrics.jsonl"
        if not p.exists():
            return []
        rows = []
        for line in p.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                break  # a torn last line from a kill: ignore it
            if not isinstance(row, dict):
                break
            rows.append(row)
        return rows

    def truncate_metrics(self, upto: int, key: str = "iteration") -> None:
        """Drop rows after iteration `upto` (on resume, rows past the last checkpoint are redone)."""
        rows = [r for r in self.metrics() if r.get(key, -1) <= upto]
        with atomic_path(self.path / "metrics.jsonl") as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))

    # -- checkpoints
    def save(self, model, tokenizer, name: str, state: dict, save_pt: bool = False, prune: bool = False) -> Path:
        """Write checkpoints/<name>/ (HF format) atomically, then state.json pointing at it; with `prune`, then
        delete every other iter-N checkpoint (`prune`)."""
        out = self.ckpt / name
        with atomic_dir(out) as tmp, quiet_transformers():
            model.save_pretrained(tmp, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        if save_pt:
            save_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()},
                            self.ckpt / f"{name}.pt")
        self.write_state({**state, "checkpoint": name})
        if prune:
            self.prune(keep=name)
        return out

    def prune(self, keep: str) -> list[Path]:
        """Delete every iter-N checkpoint but `keep` (the one state.json names: a resume never reads another),
        with its iter-N.pt; `final` is never deleted (GRPO's optimizer states have their own pruning,
        `prune_trainer_states`). Called after state.json names `keep`, so a kill part way leaves only extra
        checkpoints behind. Returns what went."""
        gone = [p for p in (self.ckpt.iterdir() if self.ckpt.is_dir() else ())
                if _ITER.fullmatch(stem := p.name.removesuffix(".pt")) and stem != keep]
        for p in gone:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
        return gone

    def reopen_final(self, state: dict) -> dict:
        """Continue a finished run: copy checkpoints/final to iter-<k>, point state.json at it, then drop
        final, so `final` only ever names the weights of a finished run (`load_model(run)` loads it).
        Each step leaves a consistent directory. Returns the new state."""
        name = checkpoint_name(state["iteration"])
        with atomic_dir(self.ckpt / name) as tmp:
            shutil.copytree(self.ckpt / "final", tmp, dirs_exist_ok=True)
        state = {**state, "checkpoint": name}
        self.write_state(state)
        shutil.rmtree(self.ckpt / "final")
        return state

    def latest(self) -> Path | None:
        """The checkpoint state.json names, if it is complete."""
        st = self.state()
        if st and (self.ckpt / st["checkpoint"] / "config.json").exists():
            return self.ckpt / st["checkpoint"]
        return None
