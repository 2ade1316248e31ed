"""Tasks: prompts, seeded train / validation / test splits, and a verifier that scores completions.

A task hands out `Problem`s in three non-overlapping splits: `test` (what evaluations report),
`validation` (what presets and any tuning may look at) and a training stream (`train(n, rng)`, drawn
by the caller's rng so runs are reproducible). Each problem carries its prompt in two forms:

    prompt     raw text for a completion model ("Q: 12-35+40=?\\nA:"), few-shot examples prefixed
    messages   the same as chat turns for an instruct model: few-shot examples as prior
               user/assistant turns, then the question as the last user turn

and the generation layer picks one (`deltalens.generation.prompts`: chat template auto / on / off).

Rewards follow arXiv 2608.27351 (after Qiu et al., arXiv 2509.24372): 1.0 correct, 0.1 well formatted
(the stated `#### <answer>` form) but wrong, 0 otherwise, computed on the completion only. Reward
functions use TRL's interface `reward(prompts, completions, **columns) -> list[float]`, so one function
serves the ES trainer and TRL's GRPOTrainer. `lenient` tasks also accept what chat models write instead
of the marker (`deltalens.tasks.answers`): correct that way earns 1, never the 0.1.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from deltalens.errors import DeltalensError
from deltalens.tasks.answers import lenient_number, normalize_number, stated_number

CORRECT, FORMATTED, WRONG = 1.0, 0.1, 0.0
SPLITS = ("validation", "test")  # fixed splits; the training stream is `Task.train`
ANSWER_FORMAT = "#### <answer>"
MAX_DRAWS = 100_000  # consecutive draws that give no new problem before a synthetic task gives up


@dataclass(frozen=True)
class Problem:
    prompt: str  # raw text given to a completion model (already formatted, e.g. "Q: 12-35+40=?\nA:")
    answer: str  # canonical answer string the verifier compares against
    solution: str | None = None  # a worked reference completion (synthetic tasks; SFT and few-shot examples)
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    # chat form: ({"role": "user" | "assistant", "content": ...}, ...), few-shot turns first; None: the prompt
    # as one user turn
    messages: tuple = field(default=None, compare=False, hash=False)

    def chat(self) -> list[dict]:
        """The problem as chat messages (for a tokenizer's chat template)."""
        if self.messages:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}]


def completion_text(c) -> str:
    """TRL passes plain strings, or for conversational data a list of messages."""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c and isinstance(c[-1], dict):
        return str(c[-1].get("content", ""))
    return str(c)


class Task:
    """Prompts + verifier. Subclasses make problems (`_make_split`, `train`) and may override
    `stated`/`lenient_answer` (answer extraction) and `check` (answer comparison)."""

    name = "task"
    max_new_tokens = 64  # generation budget that fits this task's reference solutions
    lenient = False  # also accept unmarked answers (see module docstring)
    shots = 0  # few-shot examples (from the training stream) before each problem

    def __init__(self, seed: int = 0, n_test: int = 500, n_validation: int = 500):
        self.seed, self.n_test, self.n_validation = seed, n_test, n_validation
        self._spec: str | None = None
        self._splits: dict[str, list[Problem]] = {}
        self._examples: list[Problem] | None = None

    @property
    def spec(self) -> str:
        """The spec that rebuilds this task with `get_task` (name plus every option that changes problems or
        prompts, e.g. `add:digits=1-2,terms=2,ops=+,shots=2`): what results and cache keys record. `name`
        alone (which seeds the splits) omits shots, lenient and split sizes."""
        return self._spec or self.name

    # -- splits
    def test(self, limit: int | None = None) -> list[Problem]:
        return self.split("test", limit)

    def validation(self, limit: int | None = None) -> list[Problem]:
        return self.split("validation", limit)

    def split(self, name: str, limit: int | None = None) -> list[Problem]:
        """The first `limit` problems (all with None) of a fixed split: "validation" or "test"."""
        if name not in SPLITS:
            raise DeltalensError(f"unknown split {name!r}; use validation or test (training draws its own stream)")
        if name not in self._splits:
            self._splits[name] = [self.present(p) for p in self._make_split(name)]
        if limit is not None and limit < 1:
            raise DeltalensError(f"limit must be >= 1 (got {limit})")
        return self._splits[name] if limit is None else self._splits[name][:limit]

    def train(self, n: int, rng: random.Random) -> list[Problem]:
        """n training problems drawn from `rng` (callers own the rng so runs are reproducible); never a
        validation or test problem."""
        return [self.present(p) for p in self._draw_train(n, rng)]

    def _make_split(self, name: str) -> list[Problem]:
        raise NotImplementedError

    def _draw_train(self, n: int, rng: random.Random) -> list[Problem]:
        raise NotImplementedError

    # -- prompts
    def chat_question(self, problem: Problem) -> str:
        """The user turn of a problem in chat form (default: the raw prompt)."""
        return problem.prompt

    def examples(self) -> list[Problem]:
        """The few-shot examples: the first `shots` training problems of a fixed rng."""
        if self._examples is None:
            rng = random.Random(f"{self.name}-shots-{self.seed}")
            self._examples = self._draw_train(self.shots, rng) if self.shots else []
        return self._examples

    def present(self, p: Problem) -> Problem:
        """`p` with its few-shot examples attached, in raw (prefixed text) and chat (prior turns) form."""
        shots = self.examples()
        raw = "".join(f"{e.prompt}{e.solution}\n\n" for e in shots) + p.prompt
        turns = [t for e in shots for t in ({"role": "user", "content": self.chat_question(e)},
                                             {"role": "assistant", "content": e.solution.strip()})]
        turns.append({"role": "user", "content": self.chat_question(p)})
        return Problem(raw, p.answer, p.solution, p.meta, tuple(turns))

    def stop_strings(self, chat: bool) -> tuple[str, ...]:
        """Where a completion of a raw few-shot prompt ends (`SamplingParams.stop`). The examples are
        separated by a blank line, so a base model that goes on to write the next example writes a blank
        line and the start of a prompt ("\\n\\nQ:"): the completion is cut there. Chat prompts (the template
        ends the turn with EOS) and zero-shot raw prompts have none."""
        if chat or not self.shots:
            return ()
        words = self.examples()[0].prompt.split()
        return (f"\n\n{words[0]}" if words else "\n\n",)

    # -- verification
    def stated(self, completion: str) -> str | None:
        """The answer in the stated format (`#### <answer>`), canonical, or None."""
        return stated_number(completion)

    def lenient_answer(self, completion: str) -> str | None:
        """The answer of a completion without the marker (lenient tasks only), canonical, or None."""
        return lenient_number(completion)

    def extract(self, completion: str) -> str | None:
        """The model's final answer in canonical form (used for majority voting), or None."""
        got = self.stated(completion)
        if got is None and self.lenient:
            got = self.lenient_answer(completion)
        return got

    def formatted(self, completion: str) -> bool:
        """The completion states its answer in the requested format."""
        return self.stated(completion) is not None

    def check(self, extracted: str, answer: str) -> bool:
        return extracted == normalize_number(answer)

    def verify(self, completion: str, answer: str) -> bool:
        got = self.extract(completion)
        return got is not None and self.check(got, answer)

    def score_problem(self, completion: str, problem: Problem) -> float:
        """Reward of one completion for one problem (what evaluation and ES use)."""
        return self.score(completion, problem.answer)

    def score(self, completion: str, answer: str) -> float:
        """1 correct, 0.1 well formatted (the stated format) but wrong, 0 otherwise."""
        got = self.extract(completion)
        if got is not None and self.check(got, answer):
            return CORRECT
        return FORMATTED if self.formatted(completion) else WRONG

    def reward_fn(self) -> Callable[..., list[float]]:
        """A TRL-style reward function: `(prompts, completions, answer, **kw) -> list[float]`."""

        def reward(prompts=None, completions=None, answer=None, **kwargs) -> list[float]:
            if completions is None or answer is None:
                raise ValueError("reward function needs completions= and answer= (a dataset column)")
            return [self.score(completion_text(c), a) for c, a in zip(completions, answer)]

        reward.__name__ = f"{self.name.split(':')[0]}_reward"
        return reward


class SyntheticTask(Task):
    """A generated task: `draw(rng)` makes one problem. Test: the first `n_test` distinct problems of an rng
    seeded by (name, "test", seed); validation: the first `n_validation` distinct ones of another rng that
    are not test problems; the training stream skips both."""

    def draw(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def n_distinct(self) -> int | None:
        """How many distinct problems `draw` can make (None: too many to matter)."""
        return None

    def check_size(self) -> None:
        """Refuse a problem space too small for the held-out splits: test + validation may take at most half
        of it, so the training stream keeps as many problems as are held out (else drawing would not end)."""
        space, held = self.n_distinct(), self.n_test + self.n_validation
        if space is not None and 2 * held > space:
            raise DeltalensError(f"task {self.name} has only {space} distinct problems; test {self.n_test} + "
                                 f"validation {self.n_validation} may take at most half of them: set smaller "
                                 f"test=/validation= sizes (e.g. test={space // 4},validation={space // 4}) or "
                                 "make it harder (digits, terms, ops)")

    def _draws_exhausted(self, what: str) -> DeltalensError:
        return DeltalensError(f"task {self.name}: {what} could not be drawn ({MAX_DRAWS} draws in a row gave no new "
                              "problem); the problem space is too small for the split sizes")

    def _make_split(self, name: str) -> list[Problem]:
        raw = self.__dict__.setdefault("_raw", {})
        if name not in raw:
            taken = {p.prompt for p in self._make_split("test")} if name == "validation" else set()
            rng = random.Random(f"{self.name}-{name}-{self.seed}")
            n = self.n_test if name == "test" else self.n_validation
            seen, out, misses = set(taken), [], 0
            while len(out) < n:
                p = self.draw(rng)
                if p.prompt not in seen:
                    seen.add(p.prompt)
                    out.append(p)
                    misses = 0
                elif (misses := misses + 1) > MAX_DRAWS:  # a backstop for tasks without n_distinct
                    raise self._draws_exhausted(f"{n} distinct {name} problems")
            raw[name] = out
        return raw[name]

    def _held_out(self) -> set[str]:
        if "_held_out_prompts" not in self.__dict__:
            self._held_out_prompts = {p.prompt for s in SPLITS for p in self._make_split(s)}
        return self._held_out_prompts

    def _draw_train(self, n: int, rng: random.Random) -> list[Problem]:
        held = self._held_out()
        out, misses = [], 0
        while len(out) < n:
            p = self.draw(rng)
            if p.prompt not in held:
                out.append(p)
                misses = 0
            elif (misses := misses + 1) > MAX_DRAWS:
                raise self._draws_exhausted("a training problem outside test and validation")
        return out
