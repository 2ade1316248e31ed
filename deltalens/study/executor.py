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

Torch-free; imports nothing above deltalens.errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from deltalens.errors import DeltalensError

Log = Callable[[str], None]


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


class LocalExecutor:
    """Runs the graph in this process, one task at a time, in dependency order (plan order where free).
    `progress_factory(description, total)`: the progress bars every task gets (TaskContext.progress)."""

    def __init__(self, progress_factory: Callable | None = None):
        self.progress_factory = progress_factory

    def run(self, tasks: Sequence[Task], root: Path, log: Log = print) -> dict[str, Any]:
        results: dict[str, Any] = {}
        for t in check_graph(tasks):
            ctx = TaskContext(root=Path(root), deps={d: results[d] for d in t.deps}, log=log,
                              progress=self.progress_factory)
            results[t.key] = t.fn(ctx, *t.args, **t.kwargs)
        return results
