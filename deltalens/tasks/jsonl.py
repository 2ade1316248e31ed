"""Question/answer tasks from jsonl files: `jsonl` (any fields) and `gsm8k` (Cobbe et al. 2021).

Splits. `data` is a directory or a single file:
- a directory holds test.jsonl and optionally train.jsonl and validation.jsonl; without validation.jsonl,
  `n_validation` rows of train.jsonl are held out as validation (a seeded sample) and never trained on;
- a single .jsonl file is a test set only: evaluation reads it, training refuses it (a model trained on
  its test problems would measure nothing).

Prompts ask the question and state the answer format (`#### <answer>`); the raw form keeps GSM8K's
"Question: ...\\nAnswer:" layout. GSM8K answers end with `#### <number>`, commas stripped; the verifier
is lenient (chat models answer "The answer is 18.").
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from deltalens.errors import DeltalensError
from deltalens.tasks.answers import final_answer, normalize_number
from deltalens.tasks.base import ANSWER_FORMAT, Problem, Task


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DeltalensError(f"{path}:{i}: not valid JSON ({e.msg}); fix the line or the file") from e
    except FileNotFoundError as e:
        raise DeltalensError(f"no such file: {path}") from e
    return rows


class JsonlTask(Task):
    """Question/answer pairs from jsonl files; numeric answers compared after normalisation."""

    name = "jsonl"
    max_new_tokens = 256
    lenient = True

    def __init__(self, data: str | Path, question_field: str = "question", answer_field: str = "answer",
                 seed: int = 0, prompt_template: str = "Question: {question}\nAnswer:", name: str = "jsonl",
                 n_validation: int = 500, lenient: bool = True, shots: int = 0):
        super().__init__(seed, n_test=0, n_validation=n_validation)
        self.name, self.qf, self.af, self.template = name, question_field, answer_field, prompt_template
        self.lenient, self.shots = lenient, shots
        p = Path(data)
        self.train_path = self.validation_path = None
        if p.is_dir():
            self.test_path = p / "test.jsonl"
            if (p / "train.jsonl").exists():
                self.train_path = p / "train.jsonl"
            if (p / "validation.jsonl").exists():
                self.validation_path = p / "validation.jsonl"
        else:
            self.test_path = p
        if not self.test_path.exists():
            raise DeltalensError(f"no such file: {self.test_path} (pass --data FILE.jsonl or a directory with test.jsonl)")
        self._rows_cache: dict[str, list[Problem]] = {}

    def _answer(self, raw) -> str:
        return str(raw)

    def _rows(self, path: Path) -> list[Problem]:
        out = []
        for i, row in enumerate(read_jsonl(path), 1):
            if not isinstance(row, dict) or self.qf not in row or self.af not in row:
                have = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise DeltalensError(f"{path}:{i}: missing field {self.qf!r} or {self.af!r} (have {have}); "
                                     "set --question-field/--answer-field")
            q = str(row[self.qf])
            out.append(Problem(self.template.format(question=q), self._answer(row[self.af]),
                               solution=f" {row[self.af]}", meta={"question": q}))
        if not out:
            raise DeltalensError(f"{path}: no rows")
        return out

    def _held_split(self) -> tuple[list[Problem], list[Problem]]:
        """(validation, train) from train.jsonl (+ validation.jsonl when given)."""
        if "train" not in self._rows_cache:
            if self.train_path is None:
                raise DeltalensError(f"task {self.name} has no training data: {self.test_path} is a test set; pass "
                                     "--data DIR with train.jsonl (and optionally validation.jsonl)")
            train = self._rows(self.train_path)
            if self.validation_path is not None:
                val = self._rows(self.validation_path)
            else:
                held = set(random.Random(f"{self.name}-validation-{self.seed}").sample(
                    range(len(train)), min(self.n_validation, len(train) // 2)))
                val = [p for i, p in enumerate(train) if i in held]
                train = [p for i, p in enumerate(train) if i not in held]
            test_prompts = {p.prompt for p in self._make_split("test")}
            self._rows_cache["validation"] = val
            self._rows_cache["train"] = [p for p in train if p.prompt not in test_prompts]
        return self._rows_cache["validation"], self._rows_cache["train"]

    def _make_split(self, name: str) -> list[Problem]:
        if name == "test":
            if "test" not in self._rows_cache:
                self._rows_cache["test"] = self._rows(self.test_path)
            return self._rows_cache["test"]
        return self._held_split()[0]

    def _draw_train(self, n: int, rng: random.Random) -> list[Problem]:
        rows = self._held_split()[1]
        if not rows:
            raise DeltalensError(f"task {self.name}: no training rows left after holding out validation and test")
        return [rng.choice(rows) for _ in range(n)]

    def chat_question(self, problem: Problem) -> str:
        return f"{problem.meta['question']}\nEnd your reply with the final answer as {ANSWER_FORMAT}."

    def stated(self, completion: str) -> str | None:
        got = final_answer(completion)
        if got is None:
            return None
        number = normalize_number(got)
        return number if number is not None else (got or None)

    def check(self, extracted: str, answer: str) -> bool:
        want = normalize_number(answer)
        return extracted == (want if want is not None else answer.strip())


class GSM8KTask(JsonlTask):
    """GSM8K (Cobbe et al. 2021): answers end with `#### <number>`; commas stripped."""

    name = "gsm8k"

    def __init__(self, data: str | Path | None = None, seed: int = 0, n_validation: int = 500,
                 lenient: bool = True, shots: int = 0):
        if data is None:
            data = _gsm8k_from_hub()
        super().__init__(data, "question", "answer", seed, name="gsm8k", n_validation=n_validation,
                         lenient=lenient, shots=shots)

    def _answer(self, raw) -> str:
        got = normalize_number(final_answer(str(raw)))
        if got is None:
            raise DeltalensError(f"GSM8K answer without a '#### <number>' line: {str(raw)[-60:]!r}")
        return got


def _gsm8k_from_hub() -> Path:
    """Download GSM8K test/train via `datasets` into the cache dir as jsonl files (once). Offline, one line
    saying to pass --data, without the hub client's retries (`deltalens.io.hub`)."""
    from deltalens.io import hub
    from deltalens.io.cache import cache_dir

    cache = cache_dir() / "gsm8k"
    if (cache / "test.jsonl").exists():
        return cache
    try:
        import datasets  # noqa: F401
    except ImportError as e:
        raise DeltalensError("gsm8k needs --data PATH (a jsonl or a dir with test.jsonl), "
                             "or `pip install datasets` to fetch it from the hub") from e
    why = hub.unreachable()
    if why is not None:
        raise DeltalensError(f"gsm8k is not cached here and the hub is unreachable ({why}); pass --data PATH "
                             "to a local copy (a jsonl, or a directory with test.jsonl and train.jsonl)")
    from datasets import load_dataset

    try:
        with hub.quiet():
            ds = load_dataset("openai/gsm8k", "main")
    except Exception as e:  # hub down, refused, rate-limited, ...: datasets raises many kinds
        raise DeltalensError(f"could not fetch GSM8K from the hub ({type(e).__name__}); "
                             "pass --data PATH to a local copy") from e
    cache.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        tmp = cache / f".{split}.jsonl.tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n"
                         for row in ds[split])
        tmp.replace(cache / f"{split}.jsonl")
    return cache
