"""Countdown: reach a target with + - * / using each given number exactly once.

The verifier evaluates the answer expression exactly (fractions; only digits, + - * / and parentheses are
ever parsed, never evaluated as Python) and checks that it uses the given numbers, each exactly once. The
stated format is `#### <expression>`; lenient tasks also read a `\\boxed{}` or a last line holding an
expression.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from fractions import Fraction

from deltalens.tasks.answers import _BOXED_RE, final_answer
from deltalens.tasks.base import CORRECT, FORMATTED, WRONG, Problem, SyntheticTask, completion_text

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

    def __init__(self, seed: int = 0, n_test: int = 500, n_numbers: int = 4, hi: int = 20, n_validation: int = 500,
                 lenient: bool = False, shots: int = 0):
        super().__init__(seed, n_test, n_validation)
        self.n_numbers, self.hi, self.lenient, self.shots = n_numbers, hi, lenient, shots

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

    def chat_question(self, problem: Problem) -> str:
        nums = " ".join(map(str, problem.meta["numbers"]))
        return (f"Using each of the numbers {nums} exactly once, with + - * / and parentheses, make "
                f"{problem.answer}. End your reply with the expression as #### <expression>.")
    def _numbers(self, prompt: str) -> list[int]:
        found = re.findall(r"Numbers: ([\d ]+)\.", prompt)  # the last one: few-shot examples come first
        return [int(x) for x in found[-1].split()] if found else []

    def stated(self, completion: str) -> str | None:
        """The arithmetic expression after the first `####` (spaces removed), or None."""
        expr = final_answer(completion)
        if expr is None or _eval_expr(expr) is None:
            return None
        return expr.replace(" ", "")

    def lenient_answer(self, completion: str) -> str | None:
        """Unmarked answers: the last \\boxed{expr}, else the last line's expression (before any "= target")."""
        for text in reversed(_BOXED_RE.findall(completion)):
            if _eval_expr(text.split("=")[0].strip()) is not None:
                return text.split("=")[0].replace(" ", "")
        for line in reversed([ln for ln in completion.splitlines() if ln.strip()]):
            expr = line.split("=")[0].strip().strip("*`$").strip()
            if any(op in expr for op in "+-*/") and _eval_expr(expr) is not None:
                return expr.replace(" ", "")
        return None

    def check(self, extracted: str, answer: str) -> bool:
        """Value check only; `score`/`score_problem` also check each number is used once."""
        res = _eval_expr(extracted)
        return res is not None and res[0] == Fraction(answer)

    def score_problem(self, completion: str, problem: Problem) -> float:
        return self._score(completion, problem.answer, problem.meta.get("numbers"))

    def _score(self, completion: str, answer: str, numbers: list[int] | None) -> float:
        expr = self.extract(completion)
        res = _eval_expr(expr) if expr is not None else None
        if res is not None:
            value, used = res
            if value == Fraction(answer) and (numbers is None or Counter(used) == Counter(numbers)):
                return CORRECT
        return FORMATTED if self.formatted(completion) else WRONG

    def reward_fn(self):
        def reward(prompts=None, completions=None, answer=None, numbers=None, **kwargs) -> list[float]:
            nums = numbers or [self._numbers(completion_text(p)) for p in prompts]
            return [self._score(completion_text(c), a, n) for c, a, n in zip(completions, answer, nums)]

        reward.__name__ = "countdown_reward"
        return reward

    def score(self, completion: str, answer: str, numbers: list[int] | None = None) -> float:
        return self._score(completion, answer, numbers)

    def verify(self, completion: str, answer: str, numbers: list[int] | None = None) -> bool:
        return self._score(completion, answer, numbers) == CORRECT
