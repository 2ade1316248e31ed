"""How a study's work is run: a graph of tasks, each a picklable call with declared resources.

A study (deltalens.study.run) is methods x seeds training runs plus the evaluations, sparsity sweeps and
diversity passes that read them. It is planned as a list of `Task`s: a module-level function (picklable by
reference, so a Ray worker can import it), its arguments, the keys of the tasks whose results it needs, the
resources it declares, and the paths under the study directory it writes. An executor runs the graph:

    LocalExecutor   one task after another in dependency order, in this process (the default; what a
                    study has always done)
    RayExecutor     each task a Ray task placed on a node with the resources it declares
                    (deltalens.study.ray_executor, `deltalens study --ray`)

Every task is resumable on its own (a training run resumes from its run directory, an evaluation is a
cache hit when its file exists), so an executor that dies is resumed by running the same graph again.
A task's result is small (a dict of numbers and relative paths); everything large goes to files under
the study directory, which is why `outputs` is declared: an executor whose workers do not share the
driver's disk brings those paths back.

Each task's cost goes to DIR/costs.jsonl as it finishes (`record_cost`): one JSON line per task run by
either executor, {"task", "kind", "pass_started", "finished", "wall_s", "start_rss_kb", "peak_rss_kb",
"host"}, appended across passes (a resumed study adds its own lines; a cache hit shows as a task of
seconds). The memory is the resident set of the process that ran the task, at its start and at its peak,
read every 0.1 s while it ran (`deltalens.io.usage`: the peak a lower bound; the process's, so memory held
from earlier tasks counts, and a vLLM engine's subprocess does not; None where /proc is missing). A task of
10 s or more also says it in the log: "eval:grpo-s0:t0.6: 3.1 min, peak 9.17 GiB resident (8.80 at its
start)"; the pass ends with `cost_summary`'s line.

Torch-free; imports nothing above deltalens.errors (and the leaf modules deltalens.io.usage, deltalens.timefmt).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from deltalens.errors import DeltalensError
from deltalens.io.usage import Usage, gib
from deltalens.timefmt import duration

Log = Callable[[str], None]
COSTS = "costs.jsonl"  # under the study directory: what each task cost (module docstring)
SAY_AFTER_S = 10.0  # tasks at least this long also say their cost in the log


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record_cost(root: Path, task: Task, pass_started: str, wall_s: float, start_rss_kb: int | None,
                peak_rss_kb: int | None, host: str, log: Log) -> dict:
    """Append one task's cost to ROOT/costs.jsonl (module docstring) and, for a long task, say it."""
    row = {"task": task.key, "kind": task.kind, "pass_started": pass_started, "finished": utc_now(),
           "wall_s": round(wall_s, 2), "start_rss_kb": start_rss_kb, "peak_rss_kb": peak_rss_kb, "host": host}
    try:
        with open(Path(root) / COSTS, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as e:  # a record of costs never stops the study whose work it records
        log(f"{task.key}: cannot append to {Path(root) / COSTS} ({e}); its cost is not recorded")
    if wall_s >= SAY_AFTER_S:
        peak = "" if peak_rss_kb is None else f", peak {gib(peak_rss_kb)} GiB resident" + (
            "" if start_rss_kb is None else f" ({gib(start_rss_kb)} at its start)")
        log(f"{task.key}: {duration(wall_s)}{peak}")
    return row


@dataclasses.dataclass(frozen=True)
class TaskContext:
    """What a running task is given besides its own arguments."""

    root: Path                # the study directory as this worker sees it
    deps: dict[str, Any]      # result of every task named in Task.deps, by key
    log: Log = print
    progress: Callable | None = None  # progress_factory(description, total) -> bar, or None (no bars)


@dataclasses.dataclass(frozen=True)
class Task:
    """One unit of a study's work: `fn(ctx, *args, **kwargs)` once every task in `deps` has finished."""

    key: str                                   # unique within the study, e.g. "train:es:s0", "eval:es:s0:t0.6"
    fn: Callable[..., Any]                     # a module-level function (picklable by reference)
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    deps: tuple[str, ...] = ()                 # keys of the tasks whose results this one needs
    kind: str = "task"                         # train | eval | sparsify | diversity | ... (progress tables)
    cpus: float = 1.0                          # resources it declares (Ray schedules on them)
    gpus: float = 0.0
    outputs: tuple[str, ...] = ()              # paths relative to the study directory that it writes


class Executor(Protocol):
    def run(self, tasks: Sequence[Task], root: Path, log: Log = print) -> dict[str, Any]:
        """Run every task (dependencies first); return each task's result by key."""
        ...


def check_graph(tasks: Sequence[Task]) -> list[Task]:
    """The tasks in a dependency order; refuses duplicate keys, unknown dependencies and cycles."""
    by_key: dict[str, Task] = {}
    for t in tasks:
        if t.key in by_key:
            raise DeltalensError(f"study plan: task {t.key!r} appears twice")
        by_key[t.key] = t
    for t in tasks:
        for d in t.deps:
            if d not in by_key:
                raise DeltalensError(f"study plan: task {t.key!r} needs unknown task {d!r}")
    order: list[Task] = []
    state: dict[str, int] = {}  # 1 = visiting, 2 = done

    def visit(t: Task) -> None:
        if state.get(t.key) == 2:
            return
        if state.get(t.key) == 1:
            raise DeltalensError(f"study plan: tasks depend on each other in a cycle through {t.key!r}")
        state[t.key] = 1
        for d in t.deps:
            visit(by_key[d])
        state[t.key] = 2
        order.append(t)

    for t in tasks:
        visit(t)
    return order


def cost_summary(costs: Sequence[dict]) -> str | None:
    """One line on a pass's costs (rows of costs.jsonl): tasks, their summed wall time and the largest peak
    with the first task that reached it; None for no tasks."""
    if not costs:
        return None
    n = len(costs)
    text = f"this pass: {n} task{'s' * (n != 1)}, {duration(sum(c['wall_s'] for c in costs))} of task time"
    peaks = [c for c in costs if c.get("peak_rss_kb") is not None]
    if peaks:
        top = max(peaks, key=lambda c: c["peak_rss_kb"])  # the first of equal peaks: where it was reached
        text += f", peak {gib(top['peak_rss_kb'])} GiB resident, reached in {top['task']}"
    return text + f" ({COSTS})"


class LocalExecutor:
    """Runs the graph in this process, one task at a time, in dependency order (plan order where free).
    `progress_factory(description, total)`: the progress bars every task gets (TaskContext.progress)."""

    def __init__(self, progress_factory: Callable | None = None):
        self.progress_factory = progress_factory
        self.costs: list[dict] = []  # this pass's costs.jsonl rows, in the order the tasks finished

    def run(self, tasks: Sequence[Task], root: Path, log: Log = print) -> dict[str, Any]:
        results: dict[str, Any] = {}
        started, host = utc_now(), socket.gethostname()
        self.costs = []
        for t in check_graph(tasks):
            ctx = TaskContext(root=Path(root), deps={d: results[d] for d in t.deps}, log=log,
                              progress=self.progress_factory)
            with Usage() as use:
                results[t.key] = t.fn(ctx, *t.args, **t.kwargs)
            self.costs.append(record_cost(root, t, started, use.wall_s, use.start_rss_kb, use.peak_rss_kb, host,
                                          log))
        return results
