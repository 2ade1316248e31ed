"""Sampling parameters and the generation-backend interface every backend implements."""

from __future__ import annotations

import math
from collections.abc import Callable
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


class GenerationBackend(Protocol):
    """`generate(prompts, params) -> out[i][j]`: completion j (of params.n) of prompt i, prompt excluded.
    `progress(k)` is called after every k finished sequences."""

    def generate(self, prompts: list[str], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[list[str]]: ...
