"""Every completion of an evaluation as JSONL (`deltalens eval --log-samples FILE`).

One line per model x problem x sample, in that order:

    {"model": "base", "problem": 0, "sample": 0, "prompt": "...", "answer": "7", "completion": "...",
     "extracted": "7", "reward": 1.0, "correct": true}

`problem` indexes the evaluated problems (the split's order, as in analysis.json's per_problem), reward is
the task's (1 correct, 0.1 well-formatted but wrong, 0 otherwise). The file is written like every output:
to a temporary file beside it, moved into place only when every model is done (`SampleLog` as a context
manager), so a failed or interrupted evaluation leaves no partial log, and an existing file stays as it
was until then.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from deltalens.io.atomic import atomic_path
from deltalens.tasks import CORRECT, Problem, Task


class SampleLog:
    """with SampleLog(path, task) as log: ... log.add(label, problems, completions) ..."""

    def __init__(self, path: str | os.PathLike, task: Task):
        self.path, self.task = Path(path), task
        self.lines = 0
        self._stack: contextlib.ExitStack | None = None
        self._file = None

    def __enter__(self):
        stack = contextlib.ExitStack()
        tmp = stack.enter_context(atomic_path(self.path))
        self._file = stack.enter_context(open(tmp, "w", encoding="utf-8"))
        self._stack = stack
        return self

    def __exit__(self, *exc) -> bool:
        if exc[0] is None:
            self._file.flush()
            os.fsync(self._file.fileno())
        stack, self._stack, self._file = self._stack, None, None
        return stack.__exit__(*exc)  # closes the file, then moves it into place (or deletes it on error)

    def add(self, label: str, problems: list[Problem], completions: list[list[str]]) -> None:
        """The completions[i][j] of problems[i] sampled from model `label`."""
        for i, (p, comps) in enumerate(zip(problems, completions)):
            for j, c in enumerate(comps):
                reward = self.task.score_problem(c, p)
                row = {"model": label, "problem": i, "sample": j, "prompt": p.prompt, "answer": p.answer,
                       "completion": c, "extracted": self.task.extract(c), "reward": reward,
                       "correct": reward == CORRECT}
                self._file.write(json.dumps(row, ensure_ascii=False) + "\n")
                self.lines += 1
