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
on the other side, "unclear" when it contains 0. Ratios (ES/GRPO distance) use 1 instead of 0. A bound
within 2 Monte Carlo SEs of the null touches it (`MC_SES`; the SEs from `multiplicity.quantile_mcse`). The
study applies it to Holm-adjusted intervals over all its checks (`deltalens.analysis.multiplicity`), tests
"keeps" as non-inferiority (null: minus a margin), and counts problems lost (`problems_lost`).
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
MC_SES = 2.0  # a bound within this many Monte Carlo SEs of the null touches it (issue #34)
RULE = ("Each check: reproduced when its interval lies entirely on the paper's side of the null (0 for a "
        "difference, 1 or 40 for a distance ratio, 0.5 for a share of a gain, minus the non-inferiority margin for "
        "a 'keeps' check), contradicted when it lies entirely on the other side, unclear when it contains the null "
        "(a bound within 1e-9 of it, relative for a null above 1, or within 2 Monte Carlo SEs of it for a "
        "bootstrap bound, touches it). Intervals: a bootstrap over test problems with the spread over training "
        "seeds drawn from a Student-t; a t interval over seeds for a value per training seed; Fieller's interval "
        "for a share of a gain. Multiplicity: Holm's step-down over all the study's checks at familywise 5% "
        "(two-sided p-values from the bootstrap replicates with the +1 correction, or from the t or Fieller "
        "pivot); the verdict is Holm's: the check ranked r-th smallest p of m is judged on its 1 - 0.05/(m - r + 1) "
        "interval, and only when Holm rejects it; the unadjusted 95% interval is shown beside. A claim is "
        "reproduced when all its checks are, contradicted when all are, mixed when some are, unclear otherwise.")
NONINFERIORITY = ("A 'keeps' check is a non-inferiority test: reproduced when the lower bound of method minus "
                  "base lies above -{margin:g} (the margin), contradicted when the upper bound lies below it.")


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
    s = x.shape[0]
    if s < 2:
        return np.zeros(resamples)
    return math.sqrt(seed_variance(x)) * rng.standard_t(s - 1, resamples)


def seed_variance(x: np.ndarray) -> float:
    """se_s^2 of `_seed_part` for a (S, P) table: the training-seed variance of the mean, sigma_a^2 / S
    (0 for one seed). Also the seed term of the Fieller share (`multiplicity.fieller_share`)."""
    s, p = x.shape
    if s < 2:
        return 0.0
    seed_means = x.mean(1)  # (S,)
    resid = x - x.mean(0) - seed_means[:, None] + x.mean()  # (S, P) problem x seed interaction + noise
    noise = float((resid ** 2).sum()) / ((s - 1) * (p - 1))
    var_a = max(0.0, float(seed_means.var(ddof=1)) - noise / p)
    return var_a / s


def hierarchical_bootstrap(method, base, *, trained_base: bool = False, span: float | None = None,
                           resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of mean_i (mean_s method[s, i] - mean_t base[t, i]): problems resampled, the
    method's training-seed part drawn from its Student-t (`_seed_part`), and the base's too when its seeds are
    training runs (`trained_base`), not sampling seeds of one model. `method`: (S_m, P), `base`: (S_b, P).
    `span`: the largest |difference| the metric allows (1 for a share of problems solved); the t draw is
    unbounded, so with 2 seeds that disagree its replicates can pass it, and they are clipped to +-span."""
    out = hierarchical_replicates(method, base, trained_base=trained_base, span=span, resamples=resamples,
                                  seed=seed)
    alpha = (1 - level) / 2
    return float(np.quantile(out, alpha)), float(np.quantile(out, 1 - alpha))


def hierarchical_replicates(method, base, *, trained_base: bool = False, span: float | None = None,
                            resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """The (resamples,) replicates `hierarchical_bootstrap` takes its percentiles of (the same draws for the
    same seed); `multiplicity.Replicates` turns them into p-values, Holm-level intervals and Monte Carlo SEs."""
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
    return out


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
                  resamples: int = RESAMPLES, seed: int = 0, replicates: bool = False) -> dict:
    """The effect of a method on one per-problem metric against the base (or, `trained_base`, against another
    trained method): estimate, each training seed's effect, and both intervals (`span`: see
    `hierarchical_bootstrap`). `replicates`: also return the hierarchical replicates (numpy, not JSON) under
    "replicates", the ones `ci` is the percentile interval of."""
    m, b = _matrix(method, "method"), _matrix(base, "base")
    diff = m.mean(0) - b.mean(0)
    reps = hierarchical_replicates(m, b, trained_base=trained_base, span=span, resamples=resamples, seed=seed)
    alpha = (1 - LEVEL) / 2
    out = {"estimate": float(diff.mean()), "method": float(m.mean()), "base": float(b.mean()),
           "per_seed": [float(x) for x in m.mean(1) - b.mean()],  # each training seed's effect: their spread
           "ci_problems": list(problem_bootstrap(m, b, resamples=resamples, seed=seed)),
           "ci": [float(np.quantile(reps, alpha)), float(np.quantile(reps, 1 - alpha))],
           "seeds": int(m.shape[0]), "base_seeds": int(b.shape[0]), "problems": int(m.shape[1])}
    if replicates:
        out["replicates"] = reps
    return out


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
    means = mean_replicates(v, resamples=resamples, seed=seed)
    alpha = (1 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def mean_replicates(values: Sequence[float], *, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """The (resamples,) bootstrap means `mean_bootstrap` takes its percentiles of (same seed, same draws)."""
    v = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    return v[rng.integers(0, v.size, (resamples, v.size))].mean(1)


def verdict(ci: Sequence[float], direction: int, null: float = 0.0,
            mcse: Sequence[float] | None = None) -> str:
    """reproduced / contradicted / unclear from an interval and the paper's direction (+1 raises, -1 lowers);
    an undefined interval (NaN: e.g. no gain to keep a share of) is unclear. `mcse`: the Monte Carlo SEs of
    the two bounds (`multiplicity.quantile_mcse`); a bound within 2 of them of the null touches it, since
    another set of replicates could put it on the null's other side."""
    lo, hi = ci
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "unclear"
    if direction not in (1, -1):
        raise ValueError("direction must be +1 or -1")
    tol = NULL_TOL * max(1.0, abs(null))
    se_lo, se_hi = (0.0, 0.0) if mcse is None else (float(mcse[0]), float(mcse[1]))
    above, below = lo > null + max(tol, MC_SES * se_lo), hi < null - max(tol, MC_SES * se_hi)
    if (above and direction > 0) or (below and direction < 0):
        return "reproduced"
    if (above and direction < 0) or (below and direction > 0):
        return "contradicted"
    return "unclear"


def rule_text(margin: float | None = None) -> str:
    """The verdict rule as every report states it; with `margin`, the non-inferiority sentence too."""
    return RULE if margin is None else f"{RULE} {NONINFERIORITY.format(margin=margin)}"


LOST_BASE_AT_LEAST = 4 / 32  # "problems lost": the base solves at least 4 of 32 samples (issue #34) ...
LOST_METHOD_AT_MOST = 1  # ... and a run solves at most 1 of its samples


def problems_lost(base_rates, method_correct, *, base_at_least: float = LOST_BASE_AT_LEAST,
                  method_at_most: int = LOST_METHOD_AT_MOST) -> dict:
    """The paper's narrowing counted directly: problems the base solves at a rate >= `base_at_least` (mean
    over its sampling seeds; 4/32 by default) that a trained run drops to <= `method_at_most` correct samples
    (1 of 32). `base_rates`: (S_b, P) correct/n of the base's evaluations; `method_correct`: (S_m, P) correct
    counts of each training run. Returns `eligible` (the indices of the problems the base solves),
    `per_seed` (each run's count of lost problems) and `lost`: (S_m, eligible) 0/1, one row per run, for a
    paired comparison of two methods over the eligible problems (`paired_effect(..., trained_base=True)`).
    A net Pass@K can hide it: a run may lose some problems and gain others."""
    b, m = _matrix(base_rates, "base rates"), np.atleast_2d(np.asarray(method_correct, dtype=float))
    if m.shape[1] != b.shape[1]:
        raise DeltalensError(f"problems_lost needs the same problems ({m.shape[1]} vs {b.shape[1]})")
    eligible = np.flatnonzero(b.mean(0) >= base_at_least - 1e-12)
    lost = (m[:, eligible] <= method_at_most).astype(float)
    return {"eligible": eligible, "per_seed": [int(x) for x in lost.sum(1)], "lost": lost}


def table(rows: Sequence[dict]) -> pd.DataFrame:
    """The verdict table as a DataFrame (one row per claim check), for display and CSV export."""
    cols = ["claim", "check", "method", "metric", "estimate", "ci_low", "ci_high", "direction", "null", "verdict",
            "verdict_unadjusted", "p_value", "p_holm", "holm_level", "ci_low_holm", "ci_high_holm", "mcse_low",
            "mcse_high", "interval", "seed_spread"]
    return pd.DataFrame.from_records([{c: r.get(c) for c in cols} for r in rows], columns=cols)
