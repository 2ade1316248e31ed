"""Statistics that can carry a verdict: paired differences against the base, bootstrap confidence intervals
over problems and across seeds, and one verdict rule applied the same way to every claim.

Data. For a metric m (Pass@k or Maj@k) each evaluation gives one value per test problem, m[i]. A method
is trained with S_m seeds and the base is sampled with S_b evaluation seeds, so per problem i

    d_i = mean_s m_method[s, i] - mean_t m_base[t, i]          (paired: the same problem on both sides)

and the effect is mean_i d_i. Its intervals (95%):
- over problems: percentile bootstrap, problems resampled with replacement, seeds averaged
  (`scipy.stats.bootstrap`, paired); what one seed can tell about these test problems;
- over problems and training seeds (hierarchical), the interval verdicts use: each replicate resamples the
  problems (seeds averaged) and adds a draw of the method's seed part, se_s * T with T ~ Student-t(S - 1)
  and se_s the standard error of the training-seed effect in the mean (`_seed_part`), so the spread between
  training runs counts. Why not resample the seeds too: a study has 2-5 seeds, and resampling 2-3 values
  understates their spread (the bootstrap of n values has variance (n-1)/n of the truth, and no tails
  beyond [min, max]); with 2 seeds the t draw is wide (t_1: 12.7), as it should be. The base's seeds are
  sampling seeds of one fixed model: they cannot shift every problem together, so the base gets no seed
  part (its sampling noise is in the problem part) unless the other side is a trained method too
  (`trained_base=True`: ES->GRPO vs GRPO, a sweep point vs the best). A method with one seed adds nothing:
  then the interval is the first one, what one seed can tell about these problems. `ci_problems` beside
  `ci` in analysis.json shows what the seeds add.
- a quantity with one value per training seed (a distance ratio, a top-100 share): Student-t over seeds.

Verdict rule (`verdict`), stated in every report: with the paper's direction +1 (raises) or -1
(lowers), "reproduced" when the interval excludes 0 on the paper's side, "contradicted" when it excludes 0
on the other side, "unclear" when it contains 0. Ratios (ES/GRPO distance) use 1 instead of 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import stats as sps

from deltalens.errors import DeltalensError

LEVEL = 0.95
RESAMPLES = 10_000  # the t_1 draw of 2 seeds is heavy-tailed: its 2.5% quantile has ~6% Monte Carlo error here
# A bootstrap bound that is mathematically the null comes out as e.g. 4.4e-18 (float sums of per-problem
# differences; seen in the SmolLM2 study: GRPO vs base, Pass@32, [4.44e-18, 0.213] was called contradicted).
NULL_TOL = 1e-9
RULE = ("Each check: reproduced when its 95% interval (bootstrap over test problems, with the spread over "
        "training seeds drawn from a Student-t; a t interval over seeds for a value per training seed) lies "
        "entirely on the paper's side of the null (0 for a difference, 1 or 40 for a distance ratio, 0.5 for a "
        "share of a gain), contradicted when it lies entirely on the other side, unclear when it contains the "
        "null (a bound within 1e-9 of it, relative for a null above 1, touches it: float rounding). A claim is "
        "reproduced when all its checks are, contradicted when all are, mixed when some are, unclear otherwise.")


def _matrix(values, what: str) -> np.ndarray:
    m = np.asarray(values, dtype=float)
    if m.ndim == 1:
        m = m[None, :]
    if m.ndim != 2 or m.shape[1] < 2 or not np.isfinite(m).all():
        raise DeltalensError(f"{what}: need a (seeds x problems) table of finite values with >= 2 problems")
    return m


def _seed_part(x: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """(resamples,) draws of one side's seed part, se_s * t(S-1); zeros for one seed. `x`: (S, P).

    se_s^2 = sigma_a^2 / S with sigma_a^2 the between-seed variance of the per-seed means minus what the
    problem x seed noise alone puts there (residual mean square / P, two-way ANOVA by moments, floored at 0):
    that noise is already in the problem part, and counting it twice made the interval several times too
    wide at 2 seeds where the seeds do not differ (benchmarks/bench_stats_coverage.py)."""
    s, p = x.shape
    if s < 2:
        return np.zeros(resamples)
    seed_means = x.mean(1)  # (S,)
    resid = x - x.mean(0) - seed_means[:, None] + x.mean()  # (S, P) problem x seed interaction + noise
    noise = float((resid ** 2).sum()) / ((s - 1) * (p - 1))
    var_a = max(0.0, float(seed_means.var(ddof=1)) - noise / p)
    return math.sqrt(var_a / s) * rng.standard_t(s - 1, resamples)


def hierarchical_bootstrap(method, base, *, trained_base: bool = False, span: float | None = None,
                           resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of mean_i (mean_s method[s, i] - mean_t base[t, i]): problems resampled, the
    method's training-seed part drawn from its Student-t (`_seed_part`), and the base's too when its seeds are
    training runs (`trained_base`), not sampling seeds of one model. `method`: (S_m, P), `base`: (S_b, P).
    `span`: the largest |difference| the metric allows (1 for a share of problems solved); the t draw is
    unbounded, so with 2 seeds that disagree its replicates can pass it, and they are clipped to +-span."""
    m, b = _matrix(method, "method"), _matrix(base, "base")
    if m.shape[1] != b.shape[1]:
        raise DeltalensError(f"paired comparison needs the same problems ({m.shape[1]} vs {b.shape[1]})")
    rng = np.random.default_rng(seed)
    d = m.mean(0) - b.mean(0)  # (P,) per-problem paired differences, seeds averaged
    out = d[rng.integers(0, d.size, (resamples, d.size))].mean(1)  # (resamples,) problem part
    out = out + _seed_part(m, rng, resamples)
    if trained_base:
        out = out - _seed_part(b, rng, resamples)
    if span is not None:
        out = np.clip(out, -span, span)
    alpha = (1 - level) / 2
    return float(np.quantile(out, alpha)), float(np.quantile(out, 1 - alpha))


def problem_bootstrap(method, base, *, resamples: int = RESAMPLES, level: float = LEVEL,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile interval over problems only (seeds averaged), scipy.stats.bootstrap on the paired data."""
    m, b = _matrix(method, "method").mean(0), _matrix(base, "base").mean(0)
    if np.ptp(m - b) == 0:  # every difference equal: the interval is that value
        return float((m - b)[0]), float((m - b)[0])
    res = sps.bootstrap((m, b), lambda x, y, axis=-1: (x - y).mean(axis=axis), paired=True,
                        n_resamples=resamples, confidence_level=level, method="percentile",
                        random_state=np.random.default_rng(seed), vectorized=True)
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def paired_effect(method, base, *, trained_base: bool = False, span: float | None = None,
                  resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """The effect of a method on one per-problem metric against the base (or, `trained_base`, against another
    trained method): estimate, each training seed's effect, and both intervals (`span`: see
    `hierarchical_bootstrap`)."""
    m, b = _matrix(method, "method"), _matrix(base, "base")
    diff = m.mean(0) - b.mean(0)
    return {"estimate": float(diff.mean()), "method": float(m.mean()), "base": float(b.mean()),
            "per_seed": [float(x) for x in m.mean(1) - b.mean()],  # each training seed's effect: their spread
            "ci_problems": list(problem_bootstrap(m, b, resamples=resamples, seed=seed)),
            "ci": list(hierarchical_bootstrap(m, b, trained_base=trained_base, span=span, resamples=resamples,
                                              seed=seed)),
            "seeds": int(m.shape[0]), "base_seeds": int(b.shape[0]), "problems": int(m.shape[1])}


def gain_ratio(method, reference, base, *, resamples: int = RESAMPLES, level: float = LEVEL,
               seed: int = 0) -> tuple[float, tuple[float, float]]:
    """Share of a reference's gain a method keeps: (mean(method) - mean(base)) / (mean(reference) - mean(base)),
    with a percentile interval from the same replicates as `hierarchical_bootstrap` (problems resampled; the
    method's and the reference's training-seed parts drawn from their Student-t; the base, sampling seeds of
    one model, none). Replicates whose reference gain is not positive are dropped, so the interval is
    conditional on a positive gain, and it is (nan, nan) when most are. With 2-3 seeds the t draws enter
    the denominator and the interval is wide (a width of several units is usual): a share needs seeds."""
    a, r, b = _matrix(method, "method"), _matrix(reference, "reference"), _matrix(base, "base")
    if not a.shape[1] == r.shape[1] == b.shape[1]:
        raise DeltalensError("gain_ratio needs the same problems on every side")
    gain = r.mean() - b.mean()
    est = float((a.mean() - b.mean()) / gain) if gain > 0 else float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.shape[1], (resamples, a.shape[1]))  # the same problems on every side
    pa, pr = (x.mean(0)[idx].mean(1) + _seed_part(x, rng, resamples) for x in (a, r))
    pb = b.mean(0)[idx].mean(1)
    ok = pr - pb > 0
    if ok.sum() < resamples / 2:
        return est, (float("nan"), float("nan"))
    vals = (pa[ok] - pb[ok]) / (pr[ok] - pb[ok])
    alpha = (1 - level) / 2
    return est, (float(np.quantile(vals, alpha)), float(np.quantile(vals, 1 - alpha)))


def seed_interval(values: Sequence[float], *, level: float = LEVEL) -> tuple[float, float]:
    """Student-t interval of the mean of per-seed values (e.g. a distance ratio per training seed):
    mean ± t_{n-1} · s / sqrt(n). A study has 2-5 seeds; a percentile bootstrap of so few values cannot reach
    beyond [min, max] and covers the mean far less often than it says (2 seeds: 50%, 3: 75%; see
    tests/analysis/test_stats.py), while t is exact for normal per-seed values and wide when it should be
    (2 seeds: t = 12.7). One value has no spread: the interval is undefined (NaN, NaN), so the verdict is
    unclear; one seed cannot say how much another seed would differ."""
    v = np.asarray(values, dtype=float)
    if v.size == 0 or not np.isfinite(v).all():
        raise DeltalensError("seed_interval needs finite values")
    if v.size == 1:
        return math.nan, math.nan
    half = float(sps.t.ppf((1 + level) / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size))
    return float(v.mean() - half), float(v.mean() + half)


def mean_bootstrap(values: Sequence[float], *, resamples: int = RESAMPLES, level: float = LEVEL,
                   seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the mean of many independent values (e.g. a per-prompt gap over 16 prompts);
    for a handful of seeds use `seed_interval`. Fewer than 2 values: undefined (NaN, NaN)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0 or not np.isfinite(v).all():
        raise DeltalensError("mean_bootstrap needs finite values")
    if v.size == 1:
        return math.nan, math.nan
    if np.ptp(v) == 0:
        return float(v[0]), float(v[0])
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, (resamples, v.size))].mean(1)
    alpha = (1 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def verdict(ci: Sequence[float], direction: int, null: float = 0.0) -> str:
    """reproduced / contradicted / unclear from an interval and the paper's direction (+1 raises, -1 lowers);
    an undefined interval (NaN: e.g. no gain to keep a share of) is unclear."""
    lo, hi = ci
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "unclear"
    if direction not in (1, -1):
        raise ValueError("direction must be +1 or -1")
    tol = NULL_TOL * max(1.0, abs(null))
    above, below = lo > null + tol, hi < null - tol
    if (above and direction > 0) or (below and direction < 0):
        return "reproduced"
    if (above and direction < 0) or (below and direction > 0):
        return "contradicted"
    return "unclear"


def rule_text() -> str:
    return RULE


def table(rows: Sequence[dict]) -> pd.DataFrame:
    """The verdict table as a DataFrame (one row per claim check), for display and CSV export."""
    cols = ["claim", "check", "method", "metric", "estimate", "ci_low", "ci_high", "direction", "null", "verdict"]
    return pd.DataFrame.from_records([{c: r.get(c) for c in cols} for r in rows], columns=cols)
