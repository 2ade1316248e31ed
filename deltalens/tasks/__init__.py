"""Tasks: prompts plus a verifier, with seeded train / validation / test splits (`deltalens.tasks.base`).

A task spec is a name with optional `key=value` options after a colon:

    arith                            4-term +/- sums for the bundled tiny model (strict `####` verifier)
    arith-3, arith-long, arith-big   held-out variants (3 terms; 6 terms; 3-digit numbers)
    add                              "What is 23 + 45?" for instruct models (lenient verifier)
    add:digits=1-3,terms=3,ops=+-    the difficulty knob: operand digits (n or a range), terms, operators;
                                     `test=n` sets the test size (default 500; small spaces need less)
    countdown                        reach a target using each given number once
    gsm8k                            --data DIR|FILE (test.jsonl, train.jsonl), or the hub when online
    jsonl                            --data DIR|FILE, --question-field/--answer-field

Options every task takes: `shots=k` (k few-shot examples from the training stream: prefixed text for
completion models, prior user/assistant turns in chat form) and `lenient=true|false` (accept unmarked
answers; default true for add/gsm8k/jsonl, false for arith/countdown), `validation=n` (validation size).
"""

from __future__ import annotations

from deltalens.errors import DeltalensError
from deltalens.tasks.answers import final_answer, lenient_number, normalize_number
from deltalens.tasks.arith import ARITH_STRATEGIES, AddTask, ArithTask, arith_solution
from deltalens.tasks.base import CORRECT, FORMATTED, SPLITS, WRONG, Problem, SyntheticTask, Task
from deltalens.tasks.countdown import CountdownTask
from deltalens.tasks.jsonl import GSM8KTask, JsonlTask

# name -> (constructor, its own options (name -> parser)); every task also takes COMMON
_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _bool(v: str) -> bool:
    if v.lower() not in _BOOL:
        raise ValueError
    return _BOOL[v.lower()]


COMMON = {"shots": int, "lenient": _bool, "validation": int}
TASKS = {
    "arith": (lambda **kw: ArithTask(**kw), {}),
    "arith-3": (lambda **kw: ArithTask(n_terms=3, name="arith-3", **kw), {}),
    "arith-long": (lambda **kw: ArithTask(n_terms=6, name="arith-long", **kw), {}),
    "arith-big": (lambda **kw: ArithTask(n_terms=3, lo=100, hi=400, name="arith-big", **kw), {}),
    "add": (lambda **kw: AddTask(**kw), {"digits": str, "terms": int, "ops": str, "test": int}),
    "countdown": (lambda **kw: CountdownTask(**kw), {"numbers": int, "max": int}),
}
FILE_TASKS = ("gsm8k", "jsonl")
TASK_NAMES = [*TASKS, *FILE_TASKS]
_RENAME = {"validation": "n_validation", "test": "n_test", "numbers": "n_numbers", "max": "hi"}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'add:digits=2,terms=3' -> ('add', {'digits': '2', 'terms': '3'})."""
    name, _, rest = spec.partition(":")
    opts = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise DeltalensError(f"task option {part!r} in {spec!r} must be key=value, e.g. add:digits=2,terms=3")
        opts[key.strip()] = value.strip()
    return name.strip(), opts


def _options(name: str, opts: dict[str, str], own: dict) -> dict:
    allowed = {**COMMON, **own}
    out = {}
    for key, value in opts.items():
        if key not in allowed:
            raise DeltalensError(f"task {name} has no option {key!r}; it takes {', '.join(sorted(allowed))}")
        try:
            out[_RENAME.get(key, key)] = allowed[key](value)
        except ValueError:
            raise DeltalensError(f"task option {key}={value!r} of {name} is not a valid {allowed[key].__name__}") \
                from None
    return out


def get_task(name: str, data: str | None = None, question_field: str = "question",
             answer_field: str = "answer", seed: int = 0) -> Task:
    """Build a task from its spec (see module docstring). `data` is needed for `jsonl`, optional for
    `gsm8k` (else the hub)."""
    base, opts = parse_spec(name)
    if base in TASKS:
        make, own = TASKS[base]
        kw = _options(base, opts, own)
        task = make(seed=seed, **kw)
    elif base in FILE_TASKS:
        kw = _options(base, opts, {})
        if base == "gsm8k":
            task = GSM8KTask(data, seed=seed, **kw)
        elif data is None:
            raise DeltalensError("task 'jsonl' needs --data FILE.jsonl (with --question-field/--answer-field)")
        else:
            task = JsonlTask(data, question_field, answer_field, seed=seed, **kw)
    else:
        raise DeltalensError(f"unknown task {base!r}; choose one of {', '.join(TASK_NAMES)}")
    task._spec = canonical_spec(task.name, opts, kw)
    return task


def canonical_spec(task_name: str, given: dict[str, str], parsed: dict) -> str:
    """`task_name` plus the given options its name does not already carry, in sorted order, with parsed
    values (`lenient=yes` -> `lenient=true`)."""
    _, in_name = parse_spec(task_name)
    extra = {k: parsed[_RENAME.get(k, k)] for k in given if k not in in_name}
    if not extra:
        return task_name
    text = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in sorted(extra.items()))
    return f"{task_name}{',' if in_name else ':'}{text}"


def problem_columns(problems: list[Problem]) -> dict[str, list]:
    """Columns passed to reward functions alongside prompts/completions (TRL passes dataset columns)."""
    cols: dict[str, list] = {"answer": [p.answer for p in problems]}
    if problems and "numbers" in problems[0].meta:
        cols["numbers"] = [p.meta["numbers"] for p in problems]
    return cols


__all__ = ["ARITH_STRATEGIES", "CORRECT", "FORMATTED", "SPLITS", "TASK_NAMES", "WRONG", "AddTask", "ArithTask",
           "CountdownTask", "GSM8KTask", "JsonlTask", "Problem", "SyntheticTask", "Task", "arith_solution",
           "final_answer", "get_task", "lenient_number", "normalize_number", "parse_spec", "problem_columns"]
