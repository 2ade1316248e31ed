"""Error handling, progress reporting and the parsing helpers of every command (options are generated:
cli/options.py).

Results (tables) go to stdout through `out`, logs, progress and errors to stderr through `console`, so
`deltalens eval ... > table.txt` keeps the table and a terminal still sees the logs.

Progress (`progress_bar`): on a terminal (stderr a TTY), rich's live bar. Otherwise (Slurm, CI, nohup,
`2> log`) a live bar would be noise or nothing, so each task prints a plain line instead, when it starts,
every DELTALENS_PROGRESS_EVERY seconds (default 30; 0: at every update) while it runs, even when no
update arrives (a long training iteration), and when it ends:

    eval base: 1200/3200 sequences (37%), 41 s elapsed, ~69 s left

DELTALENS_PROGRESS=1 forces the live bar, DELTALENS_PROGRESS=0 turns progress off. `FirstWork` holds
the lines a command says right before its first work (an evaluation's plan line).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from deltalens.errors import DeltalensError
from deltalens.timefmt import duration

console = Console(stderr=True)  # logs, progress, errors
out = Console(markup=False)  # results (tables) on stdout, so `> file` and pipes get them and logs stay apart;
# no markup: result tables hold user text (labels, paths, task specs) that must print as it is


def print_error(message: str) -> None:
    """The one-line error every command prints before exit 2 (or click's exit code)."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def guard(fn):
    """Turn DeltalensError into a one-line message and exit 2 (full traceback with DELTALENS_DEBUG=1)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DeltalensError as e:
            if os.environ.get("DELTALENS_DEBUG") == "1":
                raise
            print_error(str(e))
            raise typer.Exit(code=2) from None
        except KeyboardInterrupt:
            console.print("interrupted")
            raise typer.Exit(code=130) from None

    return wrapper


SPEED_WINDOW_S = 3600.0  # the live bar's speed (so its ETA) is the pace of the updates of the last hour


def progress_bar(transient: bool = False) -> Progress:
    """rich's live bar on a terminal, plain periodic lines elsewhere (module docstring), nothing with
    DELTALENS_PROGRESS=0. Use as a context manager; add tasks with `add_task` or `bar_factory`."""
    mode = os.environ.get("DELTALENS_PROGRESS")
    if mode == "0":
        return Progress(console=console, disable=True)
    if mode == "1" or sys.stderr.isatty():
        # rich estimates speed from the updates of the last `speed_estimate_period` seconds (default 30):
        # a training step of minutes (GRPO on Qwen2.5, ES on SmolLM2) would never show an ETA
        return Progress(TextColumn("{task.description}", style="bold", markup=False), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                        console=console, transient=transient, speed_estimate_period=SPEED_WINDOW_S)
    return PlainProgress(progress_every())


def progress_every() -> float:
    """Seconds between plain progress lines: DELTALENS_PROGRESS_EVERY (default 30; 0: every update)."""
    text = os.environ.get("DELTALENS_PROGRESS_EVERY", "30")
    try:
        every = float(text)
    except ValueError:
        raise DeltalensError(f"DELTALENS_PROGRESS_EVERY must be a number of seconds (got {text!r})") from None
    if not every >= 0:  # also refuses NaN
        raise DeltalensError(f"DELTALENS_PROGRESS_EVERY must be >= 0 seconds (got {text!r})")
    return every


class PlainProgress(Progress):
    """rich's Progress without its live display: tasks are tracked as usual (same API, so every caller
    works unchanged) and reported as plain lines on stderr (module docstring). A daemon thread prints the
    periodic lines, so a task whose updates are minutes apart still shows it is alive."""

    def __init__(self, every: float):
        super().__init__(console=console, disable=True)
        self.every = every
        self._last: dict = {}  # task id -> monotonic time of its last line
        self._base: dict = {}  # task id -> work done before it started (a resumed run's iterations)
        self._shown: dict = {}  # task id -> work done its last line showed
        self._ended: set = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def line(self, task_id) -> str:
        """'DESC: DONE/TOTAL UNIT (P%), E elapsed, ~R left' for one task."""
        t = self._tasks[task_id]
        unit = f" {t.fields['unit']}" if t.fields.get("unit") else ""
        done, total, elapsed = int(t.completed), t.total, t.elapsed or 0.0
        if total:
            text = f"{t.description}: {done}/{int(total)}{unit} ({100 * done / total:.0f}%), "
        else:
            text = f"{t.description}: {done}{unit}, "
        text += f"{duration(elapsed)} elapsed"
        if total and done >= total:
            text += ", done"
        elif total and done > self._base.get(task_id, 0):  # linear in the work left, at this run's pace
            text += f", ~{duration(elapsed * (total - done) / (done - self._base.get(task_id, 0)))} left"
        return text

    def _print(self, task_id) -> None:
        self._last[task_id] = time.monotonic()
        self._shown[task_id] = self._tasks[task_id].completed
        console.print(escape(self.line(task_id)), highlight=False, soft_wrap=True)

    def start(self) -> None:
        super().start()
        if self.every > 0 and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name="deltalens-progress", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(min(self.every, 1.0)):
            now = time.monotonic()
            with self._lock:
                # a bar sized by its first update (training) says nothing before it: "0, 5 s elapsed"
                # would be wrong for a resumed run, and the update prints its start line
                due = [tid for tid in self._tasks if tid not in self._ended
                       and now - self._last.get(tid, now) >= self.every
                       and not (self._tasks[tid].total is None and tid not in self._base)]
                for tid in due:
                    self._print(tid)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        with self._lock:
            for tid, t in self._tasks.items():  # the last state of tasks that never reached their total
                if tid not in self._ended:
                    self._ended.add(tid)
                    if self._shown.get(tid) != t.completed:
                        self._print(tid)
        super().stop()

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if exc_type is not None:  # the error is what matters now, not an ETA
            self._ended.update(self._tasks)
        super().__exit__(exc_type, exc_val, exc_tb)

    def add_task(self, description: str, start: bool = True, total: float | None = 100.0, completed: int = 0,
                 visible: bool = True, **fields) -> TaskID:
        with self._lock:
            tid = super().add_task(description, start=start, total=total, completed=completed, visible=visible,
                                   **fields)
            if total is None:  # sized by its first update (training): that update prints the start line
                self._last[tid] = float("-inf")
            else:
                self._base[tid] = completed
                self._print(tid)
        return tid

    def update(self, task_id, **kw) -> None:
        with self._lock:
            super().update(task_id, **kw)
            if task_id in self._ended:
                return
            t = self._tasks[task_id]
            self._base.setdefault(task_id, t.completed)
            if t.total and t.completed >= t.total:
                self._ended.add(task_id)
                self._print(task_id)
            elif time.monotonic() - self._last.get(task_id, 0.0) >= self.every:
                self._print(task_id)

    def advance(self, task_id, advance: float = 1) -> None:
        self.update(task_id, advance=advance)


# evaluation progress counts sequences (problems x samples) wherever it is reported
_UNITS = (("eval", "sequences"), ("validation", "sequences"))


def bar_factory(bar: Progress, prefix: str = "", unit: str | None = None):
    """progress_factory(desc, total) -> progress(done, total=None): one task of `bar` per call. `unit` names
    what is counted in plain progress lines (default: sequences for evaluations, else nothing). total None:
    sized by the first progress(done, total) call, whose `done` is then the work done before (a resumed
    run's steps), which the time left is not estimated from."""

    def factory(desc, total):
        name = prefix + desc
        u = unit or next((v for k, v in _UNITS if name.startswith(k)), None)
        tid = bar.add_task(name, total=total, unit=u)
        return lambda done, total=None: bar.update(tid, completed=done, **({} if total is None else {"total": total}))

    return factory


class FirstWork:
    """Lines said once, right before a command's first work: its first progress bar (or log line). The plan
    line of an evaluation (`deltalens.evaluation.cost.plan_line`) goes here, so it comes after every
    up-front check and model load has passed (a refusal stays one line) and before any generation."""

    def __init__(self, *lines: str):
        self.lines = [x for x in lines if x]

    def say(self) -> None:
        while self.lines:
            console.print(escape(self.lines.pop(0)), highlight=False, soft_wrap=True)

    def factory(self, factory):
        """progress_factory(desc, total) that says the lines first."""

        def first(desc, total):
            self.say()
            return factory(desc, total)

        return first

    def log(self, log):
        """log(text) that says the lines first."""

        def first(text):
            self.say()
            return log(text)

        return first


def parse_floats(text: str, what: str, *, empty: bool = False) -> list[float]:
    """'2.5e-4,5e-4' -> [0.00025, 0.0005] with a one-line error naming the option; `empty`: '' gives []
    (an option whose '' means none) instead of an error."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DeltalensError(f"{what} must be comma-separated numbers like 2.5e-4,5e-4 (got {text!r})") from None
    if not vals and not (empty and not text.strip()):
        raise DeltalensError(f"{what} is empty")
    return vals
