"""Up-front checks of evaluation options, so a bad value is refused before any model is loaded.

`evaluate` would refuse most of these itself, but only once a model is loaded and sampling starts
(minutes into a report or a sparsification sweep); commands call `check_eval_options` first. The
rules are the evaluation's own: `SamplingParams` (samples >= 1, temperature finite >= 0, top_p in
(0, 1]), `parse_ks` (K integers >= 1, at most the samples), and a test-problem limit >= 1 (a negative
one would slice off problems from the end).
"""

from __future__ import annotations

from collections.abc import Sequence

from deltalens.errors import DeltalensError
from deltalens.evaluation.passk import parse_ks
from deltalens.generation import SamplingParams


def check_eval_options(*, samples: int = 32, ks: str | Sequence[int] | None = None, temperature: float = 0.6,
                       limit: int | None = None, max_new_tokens: int | None = None) -> None:
    """Raise a one-line DeltalensError naming the first bad option; return None when all are valid."""
    if samples < 1:
        raise DeltalensError(f"--samples must be >= 1 (got {samples})")
    if limit is not None and limit < 1:
        raise DeltalensError(f"--limit must be >= 1 (got {limit}); omit it to evaluate every test problem")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise DeltalensError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    SamplingParams(n=samples, temperature=temperature)  # its own one-line errors
    if ks is not None:
        k = parse_ks(ks)
        if max(k) > samples:
            raise DeltalensError(f"--k {max(k)} exceeds --samples {samples}; raise --samples or lower --k")
