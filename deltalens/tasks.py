"""Tasks: prompts plus a verifier, and the reward functions ES and GRPO share.

A task is a train/test split of `Problem`s and a verifier that scores a *completion* (never the
prompt). Reward functions follow TRL's interface `reward(prompts, completions, **columns) -> list[float]`
so one function serves our ES trainer and TRL's GRPOTrainer unchanged. The default reward is the one of
arXiv 2608.27351 (after Qiu et al., arXiv 2509.24372): 1.0 correct, 0.1 well-formatted but wrong, 0 else.

Shipped tasks
- `arith`: synthetic multi-step integer +/- with a short worked solution and a final `#### <number>`
  line, like GSM8K. Several valid solution orders exist (left-to-right, positives-first, grouped; see
  `_arith_solution`); the bundled tiny model is SFT'd on a 60/30/10 mix of them. Left-to-right passes
  through negative intermediates on some problems, where positives-first does not, so a policy that
  sharpens onto the most common strategy can lose exactly those problems (the Pass@K question).
- `arith-3`, `arith-long`, `arith-big`: held-out variants (3 terms; 6 terms; 3-digit numbers) for
  forgetting checks (the tiny model never sees them in SFT; arith-3 is the one it partly solves).
- `countdown`: numbers + target; answer is an expression using each number exactly once.
- `gsm8k`: a local jsonl (or the hub via `datasets`, when online); answers after `####`, commas stripped.
- `jsonl`: any jsonl with question/answer fields named by the caller.

Synthetic tasks are seeded; test problems are drawn first and the training stream skips them, so the
splits never overlap.
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from deltalens.errors import DeltalensError

CORRECT, FORMATTED, WRONG = 1.0, 0.1, 0.0


@dataclass(frozen=True)
class Problem:
    prompt: str  # text given to the model (already formatted, e.g. "Q: 12-35+40=?\nA:")
    answer: str  # canonical answer string the verifier compares against
    solution: str | None = None  # a worked reference completion (synthetic tasks; used for SFT)
    meta: dict = field(default_factory=dict, compare=False, hash=False)


# ----------------------------------------------------------------------------- answer parsing

_FINAL_RE = re.compile(r"####\s*([^\n]*)")
_NUM_RE = re.compile(r"^-?\d+(?:\.\d+)?$")


def final_answer(completion: str) -> str | None:
    """The text after the first `####` marker, stripped; None when there is no marker.

    The first marker counts (a model that rambles on after answering is judged on what it answered).
    """
    m = _FINAL_RE.search(completion)
    if m is None:
        return None
    return m.group(1).strip()


def normalize_number(text: str | None) -> str | None:
    """'1,234' -> '1234', '$5.00' -> '5', '-3.' -> '-3'; None if `text` is not a number."""
    if text is None:
        return None
    t = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    if not _NUM_RE.match(t):
        return None
    if "." in t:
        f = Fraction(t)
        return str(f.numerator) if f.denominator == 1 else str(float(f))
    return str(int(t))


def _completion_text(c) -> str:
    """TRL passes plain strings, or for conversational data a list of messages."""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c and isinstance(c[-1], dict):
        return str(c[-1].get("content", ""))
    return str(c)


# ----------------------------------------------------------------------------- the Task class


class Task:
    """Prompts + verifier. Subclasses implement `_make_test`, `_make_train` and `extract`/`check`."""

    name = "task"
    max_new_tokens = 64  # generation budget that fits this task's reference solutions

    def __init__(self, seed: int = 0, n_test: int = 500):
        self.seed = seed
        self.n_test = n_test
        self._test: list[Problem] | None = None

    # -- splits
    def test(self, limit: int | None = None) -> list[Problem]:
        if self._test is None:
            self._test = self._make_test()
        return self._test if limit is None else self._test[:limit]

    def train(self, n: int, rng: random.Random) -> list[Problem]:
        """n training problems drawn from `rng` (callers own the rng so runs are reproducible)."""
        raise NotImplementedError

    def _make_test(self) -> list[Problem]:
        raise NotImplementedError

    # -- verification
    def extract(self, completion: str) -> str | None:
        """The model's final answer in canonical form (used for majority voting), or None."""
        return normalize_number(final_answer(completion))

    def check(self, extracted: str, answer: str) -> bool:
        return extracted == normalize_number(answer)

    def verify(self, completion: str, answer: str) -> bool:
        got = self.extract(completion)
        return got is not None and self.check(got, answer)

    def score_problem(self, completion: str, problem: Problem) -> float:
        """Reward of one completion for one problem (what evaluation and ES use)."""
        return self.score(completion, problem.answer)

    def score(self, completion: str, answer: str) -> float:
        """1 correct, 0.1 well-formatted (a parsable final answer) but wrong, 0 otherwise."""
        got = self.extract(completion)
        if got is None:
            return WRONG
        return CORRECT if self.check(got, answer) else FORMATTED

    def reward_fn(self) -> Callable[..., list[float]]:
        """A TRL-style reward function: `(prompts, completions, answer, **kw) -> list[float]`."""

        def reward(prompts=None, completions=None, answer=None, **kwargs) -> list[float]:
            if completions is None or answer is None:
                raise ValueError("reward function needs completions= and answer= (a dataset column)")
            return [self.score(_completion_text(c), a) for c, a in zip(completions, answer)]

        reward.__name__ = f"{self.name}_reward"
        return reward


# ----------------------------------------------------------------------------- arith


def _fmt_step(x: int, op: str, y: int) -> str:
    z = x + y if op == "+" else x - y
    return f"{x}{op}{y}={z}.", z


def _arith_solution(terms: list[tuple[str, int]], strategy: str) -> str:
    """Worked solution for sum of signed terms [('+', a), ('-', b), ...] in one of three orders.

    ltr:     left to right, as written (can pass through negative intermediates).
    pos:     all positive terms first, then subtract the negative ones (never negative before the end
             when the answer is non-negative).
    grouped: add the positives, add the negatives' magnitudes, subtract once (needs >=2 negatives).
    """
    steps: list[str] = []
    if strategy == "ltr":
        acc = terms[0][1]
        for op, v in terms[1:]:
            s, acc = _fmt_step(acc, op, v)
            steps.append(s)
    elif strategy in ("pos", "grouped"):
        pos = [v for op, v in terms if op == "+"]
        neg = [v for op, v in terms if op == "-"]
        acc = pos[0]
        for v in pos[1:]:
            s, acc = _fmt_step(acc, "+", v)
            steps.append(s)
        if strategy == "grouped" and len(neg) >= 2:
            nacc = neg[0]
            for v in neg[1:]:
                s, nacc = _fmt_step(nacc, "+", v)
                steps.append(s)
            s, acc = _fmt_step(acc, "-", nacc)
            steps.append(s)
        else:
            for v in neg:
                s, acc = _fmt_step(acc, "-", v)
                steps.append(s)
    else:
        raise ValueError(f"unknown arith strategy {strategy!r}")
    return " " + " ".join(steps) + f"\n#### {acc}"


ARITH_STRATEGIES = {"ltr": 0.6, "pos": 0.3, "grouped": 0.1}


class SyntheticTask(Task):
    """A generated task: `draw(rng)` makes one problem. The test split is the first `n_test` distinct
    problems of an rng seeded by (name, seed); the training stream skips every test prompt."""

    def draw(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def _make_test(self) -> list[Problem]:
        rng = random.Random(f"{self.name}-test-{self.seed}")
        seen, out = set(), []
        while len(out) < self.n_test:
            p = self.draw(rng)
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
        self._test_prompts = seen
        return out

    def train(self, n: int, rng: random.Random) -> list[Problem]:
        self.test()  # fills self._test_prompts
        out = []
        while len(out) < n:
            p = self.draw(rng)
            if p.prompt not in self._test_prompts:
                out.append(p)
        return out


class ArithTask(SyntheticTask):
    """Sums of `n_terms` signed integers in [lo, hi]; first term positive, answer >= 0."""

    name = "arith"
    max_new_tokens = 64

    def __init__(self, seed: int = 0, n_test: int = 500, n_terms: int = 4, lo: int = 2, hi: int = 60,
                 name: str = "arith"):
        super().__init__(seed, n_test)
        self.n_terms, self.lo, self.hi, self.name = n_terms, lo, hi, name
        self.max_new_tokens = 16 * n_terms + 16

    def _draw(self, rng: random.Random) -> tuple[list[tuple[str, int]], int]:
        while True:
            terms = [("+", rng.randint(self.lo, self.hi))]
            terms += [(rng.choice("+-"), rng.randint(self.lo, self.hi)) for _ in range(self.n_terms - 1)]
            value = sum(v if op == "+" else -v for op, v in terms)
            if value >= 0:
                return terms, value

    def _problem(self, terms, value, strategy: str) -> Problem:
        expr = f"{terms[0][1]}" + "".join(f"{op}{v}" for op, v in terms[1:])
        ltr_negative = any(
            sum(v if op == "+" else -v for op, v in terms[: i + 1]) < 0 for i in range(len(terms))
        )
        return Problem(
            prompt=f"Q: {expr}=?\nA:",
            answer=str(value),
            solution=_arith_solution(terms, strategy),
            meta={"strategy": strategy, "ltr_negative": ltr_negative},
        )

    def _strategy(self, rng: random.Random) -> str:
        return rng.choices(list(ARITH_STRATEGIES), weights=list(ARITH_STRATEGIES.values()))[0]

    def draw(self, rng: random.Random) -> Problem:
        terms, value = self._draw(rng)
        return self._problem(terms, value, self._strategy(rng))


# ----------------------------------------------------------------------------- countdown

_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
                  ast.UnaryOp, ast.USub)


def _eval_expr(expr: str) -> tuple[Fraction, list[int]] | None:
    """Exact value and integer literals of an arithmetic expression, or None if not one."""
    if len(expr) > 200 or not re.fullmatch(r"[\d\s+\-*/()]+", expr):
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None
    nums: list[int] = []

    def ev(node) -> Fraction:
        if not isinstance(node, _ALLOWED_NODES):
            raise ValueError  # noqa: TRY004 - "not arithmetic" is a value error, caught below
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            if not isinstance(node.value, int):
                raise ValueError  # noqa: TRY004
            nums.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp):
            return -ev(node.operand)
        a, b = ev(node.left), ev(node.right)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if b == 0:
            raise ValueError
        return a / b

    try:
        return ev(tree), nums
    except (ValueError, RecursionError):
        return None


class CountdownTask(SyntheticTask):
    """Reach `target` with + - * / using each given number exactly once (integer division exact)."""

    name = "countdown"
    max_new_tokens = 96

    def __init__(self, seed: int = 0, n_test: int = 500, n_numbers: int = 4, hi: int = 20):
        super().__init__(seed, n_test)
        self.n_numbers, self.hi = n_numbers, hi

    def draw(self, rng: random.Random) -> Problem:
        while True:
            nums = [rng.randint(1, self.hi) for _ in range(self.n_numbers)]
            # random expression over a random order: fold left with random ops, parenthesised
            order = nums[:]
            rng.shuffle(order)
            expr, val, steps = str(order[0]), Fraction(order[0]), []
            for v in order[1:]:
                op = rng.choice("+-*/")
                new = {"+": val + v, "-": val - v, "*": val * v, "/": val / v}[op]
                if new.denominator != 1 or new <= 0:
                    op, new = "+", val + v
                steps.append(f"{val}{op}{v}={new}.")
                expr = f"({expr}){op}{v}" if op in "*/" and any(c in expr for c in "+-") else f"{expr}{op}{v}"
                val = new
            if val.denominator == 1 and 0 < val <= 1000:
                prompt = f"Numbers: {' '.join(map(str, nums))}. Target: {val}.\nA:"
                return Problem(prompt, str(val), solution=" " + " ".join(steps) + f"\n#### {expr}",
                               meta={"numbers": nums})


    def _numbers(self, answer_prompt: str) -> list[int]:
        m = re.search(r"Numbers: ([\d ]+)\.", answer_prompt)
        return [int(x) for x in m.group(1).split()] if m else []

    def extract(self, completion: str) -> str | None:
        expr = final_answer(completion)
        if expr is None or _eval_expr(expr) is None:
            return None
        return expr.replace(" ", "")

    def check(self, extracted: str, answer: str) -> bool:
        """Value check only; `score`/`score_problem` also check each number is used once."""
        res = _eval_expr(extracted)
        return res is not None and res[0] == Fraction(answer)

    def score_problem(self, completion: str, problem: Problem) -> float:
        return self._score(completion, problem.answer, problem.meta.get("numbers"))

    def _score(self, completion: str, answer: str, numbers: list[int] | None) -> float:
        expr = final_answer(completion)
        res = _eval_expr(expr) if expr is not None else None
        if res is None:
            return WRONG
        value, used = res
        ok = value == Fraction(answer) and (numbers is None or Counter(used) == Counter(numbers))
        return CORRECT if ok else FORMATTED

    def reward_fn(self):
        def reward(prompts=None, completions=None, answer=None, numbers=None, **kwargs) -> list[float]:
            nums = numbers or [self._numbers(_completion_text(p)) for p in prompts]
            return [self._score(_completion_text(c), a, n) for c, a, n in zip(completions, answer, nums)]

        reward.__name__ = "countdown_reward"
        return reward

    def score(self, completion: str, answer: str, numbers: list[int] | None = None) -> float:
        return self._score(completion, answer, numbers)

    def verify(self, completion: str, answer: str, numbers: list[int] | None = None) -> bool:
        return self._score(completion, answer, numbers) == CORRECT


# ----------------------------------------------------------------------------- jsonl / gsm8k


def _read_jsonl(path: Path) -> list[dict]:
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
    """Question/answer pairs from jsonl files; numeric answers compared after normalisation.

    `data` is a .jsonl file (used as the test split, and as the train split too unless `train_data`
    is given) or a directory holding test.jsonl (and train.jsonl).
    """

    name = "jsonl"
    max_new_tokens = 256

    def __init__(self, data: str | Path, question_field: str = "question", answer_field: str = "answer",
                 seed: int = 0, prompt_template: str = "Question: {question}\nAnswer:", name: str = "jsonl"):
        super().__init__(seed, n_test=0)
        self.name, self.qf, self.af, self.template = name, question_field, answer_field, prompt_template
        p = Path(data)
        if p.is_dir():
            self.test_path, self.train_path = p / "test.jsonl", p / "train.jsonl"
            if not self.train_path.exists():
                self.train_path = self.test_path
        else:
            self.test_path = self.train_path = p
        if not self.test_path.exists():
            raise DeltalensError(f"no such file: {self.test_path} (pass --data FILE.jsonl or a directory with test.jsonl)")
        self._train_rows: list[Problem] | None = None

    def _answer(self, raw) -> str:
        return str(raw)

    def _rows(self, path: Path) -> list[Problem]:
        out = []
        for i, row in enumerate(_read_jsonl(path), 1):
            if self.qf not in row or self.af not in row:
                raise DeltalensError(
                    f"{path}:{i}: missing field {self.qf!r} or {self.af!r} (have {sorted(row)}); "
                    "set --question-field/--answer-field")
            out.append(Problem(self.template.format(question=row[self.qf]), self._answer(row[self.af])))
        if not out:
            raise DeltalensError(f"{path}: no rows")
        return out

    def _make_test(self) -> list[Problem]:
        return self._rows(self.test_path)

    def train(self, n: int, rng: random.Random) -> list[Problem]:
        if self._train_rows is None:
            self._train_rows = self._rows(self.train_path)
        return [rng.choice(self._train_rows) for _ in range(n)]

    def check(self, extracted: str, answer: str) -> bool:
        want = normalize_number(answer)
        return extracted == (want if want is not None else answer.strip())


class GSM8KTask(JsonlTask):
    """GSM8K (Cobbe et al. 2021): answers end with `#### <number>`; commas stripped."""

    name = "gsm8k"

    def __init__(self, data: str | Path | None = None, seed: int = 0):
        if data is None:
            data = _gsm8k_from_hub()
        super().__init__(data, "question", "answer", seed, name="gsm8k")

    def _answer(self, raw) -> str:
        got = normalize_number(final_answer(str(raw)))
        if got is None:
            raise DeltalensError(f"GSM8K answer without a '#### <number>' line: {str(raw)[-60:]!r}")
        return got


def _gsm8k_from_hub() -> Path:
    """Download GSM8K test/train via `datasets` into a cache dir of jsonl files."""
    try:
        import datasets  # noqa: F401
    except ImportError as e:
        raise DeltalensError("gsm8k needs --data PATH (a jsonl or a dir with test.jsonl), "
                             "or `pip install datasets` to fetch it from the hub") from e
    from datasets import load_dataset

    cache = Path.home() / ".cache" / "deltalens" / "gsm8k"
    if not (cache / "test.jsonl").exists():
        try:
            ds = load_dataset("openai/gsm8k", "main")
        except Exception as e:  # offline, hub down, ...
            raise DeltalensError(f"could not fetch GSM8K from the hub ({type(e).__name__}); "
                                 "pass --data PATH to a local copy") from e
        cache.mkdir(parents=True, exist_ok=True)
        for split in ("train", "test"):
            tmp = cache / f".{split}.jsonl.tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n" for row in ds[split])
            tmp.replace(cache / f"{split}.jsonl")
    return cache


# ----------------------------------------------------------------------------- lookup

SYNTHETIC = {
    "arith": lambda seed: ArithTask(seed=seed),
    "arith-3": lambda seed: ArithTask(seed=seed, n_terms=3, name="arith-3"),
    "arith-long": lambda seed: ArithTask(seed=seed, n_terms=6, name="arith-long"),
    "arith-big": lambda seed: ArithTask(seed=seed, n_terms=3, lo=100, hi=400, name="arith-big"),
    "countdown": lambda seed: CountdownTask(seed=seed),
}
TASK_NAMES = [*SYNTHETIC, "gsm8k", "jsonl"]


def get_task(name: str, data: str | None = None, question_field: str = "question",
             answer_field: str = "answer", seed: int = 0) -> Task:
    """Build a task by name. `data` is needed for `jsonl`, optional for `gsm8k` (else the hub)."""
    if name in SYNTHETIC:
        return SYNTHETIC[name](seed)
    if name == "gsm8k":
        return GSM8KTask(data, seed=seed)
    if name == "jsonl":
        if data is None:
            raise DeltalensError("task 'jsonl' needs --data FILE.jsonl (with --question-field/--answer-field)")
        return JsonlTask(data, question_field, answer_field, seed=seed)
    raise DeltalensError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")


def problem_columns(problems: list[Problem]) -> dict[str, list]:
    """Columns passed to reward functions alongside prompts/completions (TRL passes dataset columns)."""
    cols: dict[str, list] = {"answer": [p.answer for p in problems]}
    if problems and "numbers" in problems[0].meta:
        cols["numbers"] = [p.meta["numbers"] for p in problems]
    return cols
