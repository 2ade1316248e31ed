"""Sampling parameters and the generation-backend interface every backend implements.

Stop strings: a completion is cut before the first occurrence of any of `stop` (the string itself is not
kept, as vLLM and lm-evaluation-harness's `until` do). Tasks give them for few-shot prompts in raw text,
where a base model goes on to write the next example (`Task.stop_strings`). Backends also stop generating
a row once its text holds one: HF checks at its segment boundaries (so up to SEGMENT - 1 tokens past the
stop string are computed and thrown away), vLLM as it decodes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from deltalens.errors import DeltalensError


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 0.6  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    stop: tuple[str, ...] = ()  # cut each completion before the first of these strings (none: EOS or the limit)

    def __post_init__(self):
        if self.n < 1:
            raise DeltalensError(f"samples must be >= 1 (got {self.n})")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN would silently mean greedy
            raise DeltalensError(f"temperature must be a finite number >= 0 (got {self.temperature}); "
                                 "use 0 for greedy")
        if not 0 < self.top_p <= 1:
            raise DeltalensError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.max_new_tokens < 1:
            raise DeltalensError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if isinstance(self.stop, str) or not all(isinstance(t, str) and t for t in self.stop):
            raise DeltalensError(f"stop must be a tuple of non-empty strings (got {self.stop!r})")
        object.__setattr__(self, "stop", tuple(self.stop))


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """(text before the earliest stop string, whether one occurred)."""
    at = min((i for i in (text.find(t) for t in stop) if i >= 0), default=-1)
    return (text, False) if at < 0 else (text[:at], True)


def decode_completion(tok, ids: Sequence[int], stop: tuple[str, ...] = ()) -> str:
    """A completion's text from its new token ids, as every backend returns it: cut at the first EOS,
    decoded without special tokens, cut before the first stop string."""
    row, eos = list(ids), tok.eos_token_id
    if eos is not None and eos in row:
        row = row[: row.index(eos)]
    return cut_at_stop(tok.decode(row, skip_special_tokens=True), stop)[0]


def cut_ids_at_stop(tok, ids: Sequence[int], stop: tuple[str, ...] = ()) -> list[int]:
    """A completion's new token ids as a trainer scores and back-props them: through the first EOS (kept:
    the policy learns to stop), else through the token that completes the first stop string (kept for the
    same reason; its text is cut before the stop string, `decode_completion`), else all of them."""
    row, eos = list(ids), tok.eos_token_id
    if eos is not None and eos in row:
        row = row[: row.index(eos) + 1]
    if not stop or not cut_at_stop(tok.decode(row, skip_special_tokens=True), stop)[1]:
        return row
    lo, hi = 1, len(row)  # the shortest prefix whose text holds a stop string (holding one is monotone)
    while lo < hi:
        mid = (lo + hi) // 2
        if cut_at_stop(tok.decode(row[:mid], skip_special_tokens=True), stop)[1]:
            hi = mid
        else:
            lo = mid + 1
    return row[:lo]


class GenerationBackend(Protocol):
    """`generate(prompts, params) -> out[i][j]`: completion j (of params.n) of prompt i, prompt excluded.
    `progress(k)` is called after every k finished sequences."""

    def generate(self, prompts: list[str], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[list[str]]: ...
