"""Reading answers out of completions: the stated format first, then what chat models actually write.

Every task states one answer format in its prompt: `#### <answer>` on the last line (GSM8K's). A
completion that uses it is *well formatted*; the paper's reward gives 0.1 for a well-formatted wrong
answer. Small instruct models often answer correctly without the marker ("The answer is 42.",
"\\boxed{42}", "**Answer:** 42"), so lenient tasks fall back to those forms, in this order: the last
`\\boxed{...}`, the last "answer is/Answer: X", the last number in the reply. A fallback answer can be
correct (reward 1) but is never "well formatted" (a wrong one scores 0, not 0.1).
"""

from __future__ import annotations

import re
from fractions import Fraction

_FINAL_RE = re.compile(r"####\s*([^\n]*)")
_NUM_RE = re.compile(r"^-?\d+(?:\.\d+)?$")
# a number as people write it: 1,234 / -5 / 3.50 / $12 (thousands commas only between digit groups)
_NUMBER = r"-?\$?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\$?\d+(?:\.\d+)?"
_NUMBER_RE = re.compile(rf"(?<![\w.])({_NUMBER})")
_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")
_SAID_RE = re.compile(rf"(?:answer\s*(?:is|:|=)|answer\*\*\s*:?|=)\s*\**\s*\$?\s*({_NUMBER})", re.IGNORECASE)


def final_answer(completion: str) -> str | None:
    """The text after the first `####` marker, stripped; None when there is no marker.

    The first marker counts (a model that rambles on after answering is judged on what it answered).
    """
    m = _FINAL_RE.search(completion)
    if m is None:
        return None
    return m.group(1).strip()


def normalize_number(text: str | None) -> str | None:
    """'1,234' -> '1234', '$5.00' -> '5', '-3.' -> '-3', '42.' -> '42'; None if `text` is not a number."""
    if text is None:
        return None
    t = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    if t.startswith("-$"):
        t = "-" + t[2:]
    if not _NUM_RE.match(t):
        return None
    if "." in t:
        f = Fraction(t)
        return str(f.numerator) if f.denominator == 1 else str(float(f))
    return str(int(t))


def stated_number(completion: str) -> str | None:
    """The number after the first `####` (the stated format), normalised; None without a marker."""
    return normalize_number(final_answer(completion))


def lenient_number(completion: str) -> str | None:
    """The answer a chat model wrote without the marker: last \\boxed{}, else last "answer is X" (or
    "= X"), else the last number in the text; normalised, None when there is no number at all."""
    boxed = _BOXED_RE.findall(completion)
    for text in reversed(boxed):
        n = normalize_number(text.replace("\\,", "").replace("{", "").replace("}", ""))
        if n is not None:
            return n
    said = _SAID_RE.findall(completion)
    if said:
        n = normalize_number(said[-1])
        if n is not None:
            return n
    numbers = _NUMBER_RE.findall(completion)
    return normalize_number(numbers[-1]) if numbers else None
