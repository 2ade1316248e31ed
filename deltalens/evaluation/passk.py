"""Pass@K and Maj@K estimators (pure functions of per-sample correctness and answers).

Pass@K is the unbiased estimator of Chen et al. (2021), as used in arXiv 2608.27351: with n samples of
which c are correct, pass@k = 1 - C(n-c, k) / C(n, k), computed in the numerically stable product form
1 - prod_{i=n-c+1}^{n} (1 - k/i) (no huge binomials), and exactly 1 when n - c < k.

Maj@K (majority voting over k samples): the final answers of k samples vote; the most frequent
non-empty answer wins (ties split evenly, counted as the expected value), correct if it is correct.
We report its expectation over size-k subsets of the n samples: exact for k = 1 (= c/n) and k = n; for
1 < k < n the mean over `maj_subsets` random subsets (seeded; a Monte Carlo estimate, not exact).

Each Pass@K comes with its standard error over problems (`pass_at_k_se`): the sample standard deviation
of the per-problem unbiased estimates divided by sqrt(P), P the number of problems. It measures how much
the estimate would move with another draw of problems (and of samples), not the bootstrap of
`deltalens.analysis.stats`; it is None for a single problem.

Defaults follow the paper: 32 samples at temperature 0.6, K in {1, 16, 32}. `fit_ks` fits the Ks to the
samples drawn: Pass@K needs K <= n, so the Ks above n are replaced by n itself (the largest K n samples
estimate), with a note saying so; only a request whose every K exceeds n is refused.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

from deltalens.errors import DeltalensError
from deltalens.tasks import CORRECT, Problem, Task


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: n samples, c correct. Requires 1 <= k <= n, 0 <= c <= n."""
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def _majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> float:
    """Expected correctness of majority vote over these samples (ties split evenly)."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winners = [a for a, v in votes.items() if v == top]
    right = {a for a, ok in zip(answers, correct) if ok and a is not None}
    return sum(w in right for w in winners) / len(winners)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int,
             subsets: int = 200, seed: int = 0) -> float:
    """Maj@k expected over size-k subsets of the samples (exact for k=1 and k=n)."""
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj_at_k needs 1 <= k <= n (n={n}, k={k})")
    if k == n:
        return _majority_correct(answers, correct)
    if k == 1:
        return sum(1 for a, ok in zip(answers, correct) if ok and a is not None) / n
    rng = random.Random(seed)
    idx = list(range(n))
    total = 0.0
    for _ in range(subsets):
        pick = rng.sample(idx, k)
        total += _majority_correct([answers[i] for i in pick], [correct[i] for i in pick])
    return total / subsets


def maj_curve(answers: Sequence[str | None], correct: Sequence[bool], subsets: int = 200,
              seed: int = 0) -> list[float]:
    """Maj@k for every k = 1..n at once (vectorised `maj_at_k`).

    Draw `subsets` random orderings of the n samples; the first k of each ordering is a uniform size-k
    subset, so cumulative vote counts along the orderings give every k in one pass:
    counts[r, k-1, a] = votes for answer a among the first k samples of ordering r. Shapes below.
    Exact for k = 1 and k = n; Monte Carlo in between (same estimator as `maj_at_k`).
    """
    import numpy as np

    n = len(answers)
    ids = {a: i for i, a in enumerate(sorted({a for a in answers if a is not None}))}
    if not ids:
        return [0.0] * n
    A = len(ids)
    onehot = np.zeros((n, A), dtype=np.int32)  # (n samples, A answers); None votes for nothing
    right = np.zeros(A, dtype=bool)  # is answer a correct
    for j, (a, ok) in enumerate(zip(answers, correct)):
        if a is not None:
            onehot[j, ids[a]] = 1
            right[ids[a]] |= bool(ok)
    rng = np.random.default_rng(seed)
    perm = np.argsort(rng.random((subsets, n)), axis=1)  # (R, n) random orderings
    counts = np.cumsum(onehot[perm], axis=1)  # (R, n, A)
    top = counts.max(axis=2, keepdims=True)  # (R, n, 1)
    winners = (counts == top) & (top > 0)  # (R, n, A); no winner when no sample voted
    n_win = winners.sum(axis=2)
    frac = np.where(n_win > 0, (winners & right).sum(axis=2) / np.maximum(n_win, 1), 0.0)  # (R, n)
    curve = frac.mean(axis=0).tolist()
    curve[0] = sum(1 for a, ok in zip(answers, correct) if ok and a is not None) / n  # exact k = 1
    curve[-1] = _majority_correct(answers, correct)  # exact k = n
    return curve


def parse_ks(text: str | Sequence[int]) -> list[int]:
    """'1,16,32' -> [1, 16, 32] with a clear error for junk."""
    if not isinstance(text, str):
        return sorted({int(k) for k in text})
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise DeltalensError(f"--k must be comma-separated integers like 1,16,32 (got {text!r})") from None
    if not ks or ks[0] < 1:
        raise DeltalensError(f"--k values must be >= 1 (got {text!r})")
    return ks


def fit_ks(ks: Sequence[int], samples: int) -> tuple[list[int], str | None]:
    """(the Ks n=`samples` samples can estimate, a note or None): the Ks above n are dropped and n itself
    takes their place (added if absent), e.g. ([1, 16, 32], 8) -> ([1, 8], '--k 16,32 exceed --samples 8:
    reporting Pass@1,8'). When no K is <= n nothing of the request can be reported: a DeltalensError."""
    ks = sorted(set(ks))
    over = [k for k in ks if k > samples]
    if not over:
        return ks, None
    if len(over) == len(ks):
        raise DeltalensError(f"--k {','.join(map(str, over))} {'exceeds' if len(over) == 1 else 'exceed'} "
                             f"--samples {samples}; raise --samples or lower --k")
    kept = sorted({k for k in ks if k <= samples} | {samples})
    verb = "exceeds" if len(over) == 1 else "exceed"
    return kept, (f"--k {','.join(map(str, over))} {verb} --samples {samples}: "
                  f"reporting Pass@{','.join(map(str, kept))}")


def standard_error(values: Sequence[float]) -> float | None:
    """Standard error of the mean of `values`: sample standard deviation (n-1) / sqrt(n); None for n < 2."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return math.sqrt(var) / math.sqrt(n)


def pass_at_k_se(counts: Sequence[tuple[int, int]], k: int) -> float | None:
    """Standard error over problems of Pass@k from (n samples, c correct) per problem."""
    return standard_error([pass_at_k(n, c, k) for n, c in counts])


def summarize(task: Task, problems: list[Problem], completions: list[list[str]], ks: list[int],
              maj_subsets: int = 200, seed: int = 0, keep_completions: int = 0) -> dict:
    """Pass@K/Maj@K curves and per-problem results from completions[i][j] (problem i, sample j)."""
    n = len(completions[0])
    if max(ks) > n:
        raise DeltalensError(f"--k {max(ks)} exceeds --samples {n}; raise --samples or lower --k")
    per_problem, rewards, n_formatted = [], [], 0
    curve_k = list(range(1, n + 1))
    pass_sum = [0.0] * n
    maj_sum = [0.0] * n
    for i, (p, comps) in enumerate(zip(problems, completions)):
        scores = [task.score_problem(c, p) for c in comps]
        ok = [s == CORRECT for s in scores]
        answers = [task.extract(c) for c in comps]
        c = sum(ok)
        formatted = sum(task.formatted(x) for x in comps)  # the stated answer format (reward >= 0.1)
        n_formatted += formatted
        rewards.extend(scores)
        maj = maj_curve(answers, ok, maj_subsets, seed + i)
        for k in curve_k:
            pass_sum[k - 1] += pass_at_k(n, c, k)
            maj_sum[k - 1] += maj[k - 1]
        majority = Counter(a for a in answers if a is not None).most_common(1)
        row = {"prompt": p.prompt, "answer": p.answer, "correct": c, "n": n, "formatted": formatted,
               "majority": majority[0][0] if majority else None,
               "maj_at_k": {str(k): maj[k - 1] for k in ks}}  # per problem, for paired statistics
        if keep_completions:
            row["completions"] = comps[:keep_completions]
            row["completions_correct"] = ok[:keep_completions]  # the report marks each one
        per_problem.append(row)
    m = len(problems)
    counts = [(row["n"], row["correct"]) for row in per_problem]
    curve_pass = [s / m for s in pass_sum]
    curve_maj = [s / m for s in maj_sum]
    return {
        "pass_at_k": {str(k): curve_pass[k - 1] for k in ks},
        "pass_at_k_se": {str(k): pass_at_k_se(counts, k) for k in ks},
        "maj_at_k": {str(k): curve_maj[k - 1] for k in ks},
        "curve": {"k": curve_k, "pass": curve_pass, "maj": curve_maj},
        "mean_reward": sum(rewards) / len(rewards),
        "format_rate": n_formatted / len(rewards),
        "per_problem": per_problem,
    }
