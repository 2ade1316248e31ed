"""Arithmetic tasks: `arith` (the bundled tiny model's task) and the `add` family for instruct models.

`arith`: sums of `n_terms` signed integers in [lo, hi] (first term positive, answer >= 0), prompted as
"Q: 12-35+40=?\\nA:" with a worked solution and a final `#### <number>` line, like GSM8K. Several valid
solution orders exist (left to right, positives first, grouped; `arith_solution`); the bundled tiny
model is SFT'd on a 60/30/10 mix of them. Left to right passes through negative intermediates on some
problems, where positives-first does not, so a policy that sharpens onto the most common order can lose
exactly those problems (the Pass@K question). Strict: only the `####` form counts, as in SFT.

`add`: a difficulty knob for models that already read English: `terms` operands of `digits` digits
(one number, or a range like 1-3, drawn per operand), joined by the operators in `ops` (+, -, *;
evaluated with the usual precedence). The prompt asks the question in words and states the answer
format; the verifier is lenient (`deltalens.tasks.answers`), since chat models answer "The sum is 68."
"""

from __future__ import annotations

import random

from deltalens.errors import DeltalensError
from deltalens.tasks.base import ANSWER_FORMAT, Problem, SyntheticTask


def _fmt_step(x: int, op: str, y: int) -> tuple[str, int]:
    z = x + y if op == "+" else x - y
    return f"{x}{op}{y}={z}.", z


def arith_solution(terms: list[tuple[str, int]], strategy: str) -> str:
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


class ArithTask(SyntheticTask):
    """Sums of `n_terms` signed integers in [lo, hi]; first term positive, answer >= 0."""

    name = "arith"
    max_new_tokens = 64

    def __init__(self, seed: int = 0, n_test: int = 500, n_terms: int = 4, lo: int = 2, hi: int = 60,
                 name: str = "arith", n_validation: int = 500, lenient: bool = False, shots: int = 0):
        super().__init__(seed, n_test, n_validation)
        self.n_terms, self.lo, self.hi, self.name = n_terms, lo, hi, name
        self.lenient, self.shots = lenient, shots
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
            solution=arith_solution(terms, strategy),
            meta={"strategy": strategy, "ltr_negative": ltr_negative, "expr": expr},
        )

    def _strategy(self, rng: random.Random) -> str:
        return rng.choices(list(ARITH_STRATEGIES), weights=list(ARITH_STRATEGIES.values()))[0]

    def draw(self, rng: random.Random) -> Problem:
        terms, value = self._draw(rng)
        return self._problem(terms, value, self._strategy(rng))

    def chat_question(self, problem: Problem) -> str:
        return (f"Compute {problem.meta['expr']}. Work it out step by step, then give the final answer on the "
                f"last line as {ANSWER_FORMAT}.")


def parse_digits(value) -> tuple[int, int]:
    """'2' -> (2, 2), '1-3' -> (1, 3): the range of operand digit counts."""
    text = str(value)
    try:
        lo, _, hi = text.partition("-")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise DeltalensError(f"digits must be a number or a range like 1-3 (got {text!r})") from None
    if not 1 <= lo <= hi <= 9:
        raise DeltalensError(f"digits must be between 1 and 9 (got {text!r})")
    return lo, hi


class AddTask(SyntheticTask):
    """`terms` operands of `digits` digits joined by `ops`, asked in words; lenient verifier."""

    max_new_tokens = 96
    lenient = True

    def __init__(self, seed: int = 0, digits: str | int = 2, terms: int = 2, ops: str = "+", n_test: int = 500,
                 n_validation: int = 500, shots: int = 0, lenient: bool = True, name: str | None = None):
        super().__init__(seed, n_test, n_validation)
        self.digits = parse_digits(digits)
        if not 2 <= int(terms) <= 8:
            raise DeltalensError(f"terms must be between 2 and 8 (got {terms})")
        if not ops or set(ops) - set("+-*"):
            raise DeltalensError(f"ops must be made of + - * (got {ops!r})")
        self.terms, self.ops, self.shots, self.lenient = int(terms), "".join(sorted(set(ops), key="+-*".index)), \
            int(shots), bool(lenient)
        d = f"{self.digits[0]}" if self.digits[0] == self.digits[1] else f"{self.digits[0]}-{self.digits[1]}"
        self.name = name or f"add:digits={d},terms={self.terms},ops={self.ops}"
        self.check_size()

    def n_distinct(self) -> int | None:
        lo, hi = self.digits
        values = 10 ** hi - (10 ** (lo - 1) if lo > 1 else 0)  # operands: every number with lo..hi digits
        return values ** self.terms * len(self.ops) ** (self.terms - 1)

    def _operand(self, rng: random.Random) -> int:
        d = rng.randint(*self.digits)
        return rng.randint(10 ** (d - 1) if d > 1 else 0, 10 ** d - 1)

    def draw(self, rng: random.Random) -> Problem:
        nums = [self._operand(rng) for _ in range(self.terms)]
        ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
        expr = str(nums[0]) + "".join(f" {o} {n}" for o, n in zip(ops, nums[1:]))
        value = eval(expr.replace(" ", ""), {"__builtins__": {}})  # digits and + - * only: built here
        return Problem(prompt=f"Q: What is {expr}?\nA:", answer=str(value), solution=f" {expr} = {value}.\n#### {value}",
                       meta={"expr": expr, "operands": nums})

    def chat_question(self, problem: Problem) -> str:
        return f"What is {problem.meta['expr']}? End your reply with the final answer as {ANSWER_FORMAT}."
