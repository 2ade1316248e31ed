"""Verdicts over a family of checks: Holm's step-down, Monte Carlo error of bootstrap bounds, Fieller's
interval for a share of a gain (issue #34).

A study tests ~30 directional checks at 95% each; by chance alone one or two of them exclude the null. The
verdicts `deltalens.study` reports are therefore Holm-adjusted across all the study's checks.

Evidence. Every check carries one of
- `Replicates`: bootstrap replicates of the effect (`stats.hierarchical_replicates`, `stats.mean_replicates`);
  interval at level L: the (1-L)/2 and (1+L)/2 percentiles; two-sided p-value against a null v
      p = min(1, 2 min(#{r <= v} + 1, #{r >= v} + 1) / (R + 1))
  (the +1 correction of Davison & Hinkley 1997, eq. 4.11: a bootstrap p-value is never 0); ties with the
  null (within `stats.NULL_TOL`) count on both sides.
- `TStat`: a mean, its standard error and degrees of freedom (a t interval over training seeds,
  `stats.seed_interval`; df = inf is the normal interval); p from the t distribution.
- `Fieller`: a ratio A / G of two estimated means with variances vA, vG and covariance c (`fieller_share`).
  Fieller's interval is the set of rho the t-test of A - rho G = 0 does not reject,
      (A - rho G)^2 <= t^2 (vA - 2 rho c + rho^2 vG),
  a quadratic in rho; bounded when G^2 > t^2 vG (the gain is itself significantly non-zero), and then
  [(b - sqrt(b^2 - a c0)) / a, (b + sqrt(...)) / a] with a = G^2 - t^2 vG, b = AG - t^2 c, c0 = A^2 - t^2 vA.
  Otherwise the set is unbounded and we report it undefined (NaN): a share of a gain that may be zero is
  unclear, whatever its numerator (as is a share of a gain significantly below 0). p for the null rho0 is
  that same t-test, so interval and p-value agree. Why not the percentile interval of the ratio
  (`stats.gain_ratio`): with a noisy denominator the replicate ratios are heavy-tailed and their percentiles
  do not hold the truth at their stated rate; Fieller is exact for normal A, G.

Holm (1979). With m two-sided p-values sorted p_(1) <= ... <= p_(m), the adjusted p-value of the r-th is
max_{j<=r} min(1, (m - j + 1) p_(j)); a check is rejected (reproduced or contradicted) when its adjusted p
is <= alpha = 0.05, which controls the familywise error at 5% under any dependence between the checks.
The family is every check the study reports, m of them; a check without evidence (one seed, no interval)
counts with p = 1 (it can never be rejected, and it is part of what was tested).

The adjusted interval. Holm gives no simultaneous intervals; what we report beside each check is its
interval at the level Holm tests it at: rank r (ties share the smallest rank of their p) gets level
1 - alpha / (m - r + 1), so the smallest p is judged on a Bonferroni 1 - alpha/m interval and the largest on
the unadjusted 95% one. It is the interval that excludes the null exactly when that step of Holm's
procedure rejects (up to Monte Carlo error of the bootstrap); it is not a joint 95% coverage statement
for all checks (Bonferroni's 1 - alpha/m intervals for every check would be, and are wider). The adjusted
verdict is reproduced / contradicted only when Holm rejects AND the adjusted interval lies beyond the null
by more than 2 Monte Carlo SEs of its bound; otherwise unclear. Departure from the usual practice: the
papers under test report no multiplicity control at all.

Monte Carlo error (`quantile_mcse`). A percentile bound from R replicates is itself random. By the
binomial argument for order statistics, the count of replicates below the true q-quantile is
Binomial(R, q), so the order statistics of rank Rq +- 2 sqrt(Rq(1-q)) bracket it with ~95% probability,
and a quarter of their distance (exactly: the distance times sqrt(Rq(1-q)) / the rank gap) estimates the
SE of the bound: a difference quotient for sqrt(q(1-q)/R) / f(x_q) that needs no density estimate and
shrinks like 1/sqrt(R). On normal replicates it is unbiased to a few % with a relative noise of ~12% at
R = 10,000, q = 0.025 (the +-1 SD window: ~18%). Far in a tail (Holm levels: q = 0.025/m) the window
holds few replicates, and the SE says so. Analytic intervals (t, Fieller) have none (0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from deltalens.analysis import stats
from deltalens.errors import DeltalensError

ALPHA = 1 - stats.LEVEL  # familywise error of Holm's procedure


def quantile_mcse(values, q: float) -> float:
    """Monte Carlo SE of the q-quantile of R replicates (order-statistic method, module docstring)."""
    x = np.sort(np.asarray(values, dtype=float))
    r = x.size
    if r < 2 or not 0 < q < 1:
        raise DeltalensError("quantile_mcse needs >= 2 replicates and 0 < q < 1")
    h = math.sqrt(r * q * (1 - q))  # the binomial SD of the count below the q-quantile
    centre = q * (r - 1)  # np.quantile's (linear) position of the q-quantile
    j1, j2 = max(0, math.floor(centre - 2 * h)), min(r - 1, math.ceil(centre + 2 * h))
    if j2 <= j1:
        return 0.0
    return float((x[j2] - x[j1]) * h / (j2 - j1))


def _tails(level: float) -> tuple[float, float]:
    a = (1 - level) / 2
    return a, 1 - a


@dataclass(frozen=True)
class Replicates:
    """A check's bootstrap replicates (percentile intervals)."""

    kind = "bootstrap"  # analysis.json's `interval`

    values: np.ndarray

    def interval(self, level: float) -> tuple[float, float]:
        lo, hi = _tails(level)
        return float(np.quantile(self.values, lo)), float(np.quantile(self.values, hi))

    def mcse(self, level: float) -> tuple[float, float]:
        lo, hi = _tails(level)
        return quantile_mcse(self.values, lo), quantile_mcse(self.values, hi)

    def p_value(self, null: float) -> float:
        tol = stats.NULL_TOL * max(1.0, abs(null))
        r = self.values.size
        below = int(np.count_nonzero(self.values <= null + tol))
        above = int(np.count_nonzero(self.values >= null - tol))
        return min(1.0, 2 * (min(below, above) + 1) / (r + 1))


@dataclass(frozen=True)
class TStat:
    """mean +- t_df * se (df = inf: normal)."""

    kind = "t"  # analysis.json's `interval`

    mean: float
    se: float
    df: float

    @classmethod
    def from_seeds(cls, values: Sequence[float]) -> TStat | None:
        """The t interval over per-seed values of `stats.seed_interval`; None for one value (no spread)."""
        v = np.asarray(values, dtype=float)
        if v.size < 2:
            return None
        return cls(float(v.mean()), float(v.std(ddof=1) / math.sqrt(v.size)), float(v.size - 1))

    def _crit(self, level: float) -> float:
        p = (1 + level) / 2
        return float(sps.norm.ppf(p) if math.isinf(self.df) else sps.t.ppf(p, self.df))

    def interval(self, level: float) -> tuple[float, float]:
        half = self._crit(level) * self.se
        return self.mean - half, self.mean + half

    def mcse(self, level: float) -> tuple[float, float]:
        return 0.0, 0.0

    def p_value(self, null: float) -> float:
        diff = self.mean - null
        if self.se <= 0:
            return 1.0 if abs(diff) <= stats.NULL_TOL * max(1.0, abs(null)) else 0.0
        z = abs(diff) / self.se
        return float(2 * (sps.norm.sf(z) if math.isinf(self.df) else sps.t.sf(z, self.df)))


@dataclass(frozen=True)
class Fieller:
    """The ratio a / g with var(a) = va, var(g) = vg, cov(a, g) = cov; t critical values with df."""

    kind = "fieller"  # analysis.json's `interval`

    a: float
    g: float
    va: float
    vg: float
    cov: float
    df: float

    @property
    def estimate(self) -> float:
        return self.a / self.g if self.g > 0 else math.nan

    def interval(self, level: float) -> tuple[float, float]:
        p = (1 + level) / 2
        t2 = float(sps.norm.ppf(p) if math.isinf(self.df) else sps.t.ppf(p, self.df)) ** 2
        qa = self.g ** 2 - t2 * self.vg
        if self.g <= 0 or qa <= 0:  # the gain is not significantly positive: the set is unbounded
            return math.nan, math.nan
        qb = self.a * self.g - t2 * self.cov
        qc = self.a ** 2 - t2 * self.va
        root = math.sqrt(max(0.0, qb * qb - qa * qc))
        return (qb - root) / qa, (qb + root) / qa

    def mcse(self, level: float) -> tuple[float, float]:
        return 0.0, 0.0

    def p_value(self, null: float) -> float:
        if self.g <= 0:
            return 1.0
        diff = self.a - null * self.g
        var = self.va - 2 * null * self.cov + null ** 2 * self.vg
        if var <= 0:
            return 1.0 if abs(diff) <= stats.NULL_TOL * max(1.0, abs(null)) else 0.0
        z = abs(diff) / math.sqrt(var)
        return float(2 * (sps.norm.sf(z) if math.isinf(self.df) else sps.t.sf(z, self.df)))


def fieller_share(method, reference, base) -> tuple[float, Fieller]:
    """Share of a reference's gain a method keeps, (mean(method) - mean(base)) / (mean(reference) -
    mean(base)), as Fieller evidence. (S, P) tables on the same problems. vA, vG, cov: the per-problem paired
    differences' (co)variances / P, plus each trained side's seed variance (`stats.seed_variance`; the
    method's and the reference's runs are independent, so no seed covariance; the base, sampling seeds of
    one model, none). df: Welch-Satterthwaite of var(A - rho G) at the estimate (problem part P - 1, each
    seed part S - 1), so 2-3 seeds give the wide t critical values they should."""
    a, r, b = (stats._matrix(x, w) for x, w in ((method, "method"), (reference, "reference"), (base, "base")))
    if not a.shape[1] == r.shape[1] == b.shape[1]:
        raise DeltalensError("fieller_share needs the same problems on every side")
    p = a.shape[1]
    ai, gi = a.mean(0) - b.mean(0), r.mean(0) - b.mean(0)
    cm = np.cov(np.stack([ai, gi]), ddof=1) / p
    vsa, vsg = stats.seed_variance(a), stats.seed_variance(r)
    A, G = float(ai.mean()), float(gi.mean())
    rho = A / G if G > 0 else 0.0
    terms = [(float(cm[0, 0] - 2 * rho * cm[0, 1] + rho ** 2 * cm[1, 1]), p - 1),
             (vsa, a.shape[0] - 1), (rho ** 2 * vsg, r.shape[0] - 1)]
    terms = [(v, d) for v, d in terms if v > 0 and d >= 1]
    total = sum(v for v, _ in terms)
    df = total ** 2 / sum(v ** 2 / d for v, d in terms) if total > 0 else math.inf
    ev = Fieller(A, G, float(cm[0, 0]) + vsa, float(cm[1, 1]) + vsg, float(cm[0, 1]), float(df))
    return ev.estimate, ev


def holm(p_values: Sequence[float]) -> tuple[list[float], list[int]]:
    """Holm's adjusted p-values and each p's rank (1 = smallest; ties share the smallest rank)."""
    p = np.asarray(p_values, dtype=float)
    if p.size == 0:
        return [], []
    if not (np.isfinite(p).all() and (p >= 0).all() and (p <= 1).all()):
        raise DeltalensError("holm needs p-values in [0, 1]")
    m = p.size
    order = np.argsort(p, kind="stable")
    adj_sorted = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * p[order]))
    adj = np.empty(m)
    adj[order] = adj_sorted
    ranks = [int(np.count_nonzero(p < x)) + 1 for x in p]  # 1 + how many are strictly smaller
    return [float(x) for x in adj], ranks


def judge(tests: Sequence[tuple], alpha: float = ALPHA) -> list[dict]:
    """Verdicts of a family of checks. `tests`: (evidence or None, null, direction +1/-1) per check.
    Returns per check: the unadjusted 95% interval and its bounds' Monte Carlo SEs, its verdict
    (`verdict_unadjusted`), the two-sided p-value, Holm's adjusted p, the level Holm tests it at and the
    interval at that level with its MC SEs, and `verdict`: Holm's (module docstring)."""
    level = 1 - alpha
    rows = []
    for ev, null, direction in tests:
        if ev is None:
            rows.append({"ci": (math.nan, math.nan), "mcse": (math.nan, math.nan), "p": 1.0})
            continue
        ci, se = ev.interval(level), ev.mcse(level)
        rows.append({"ci": ci, "mcse": se, "p": ev.p_value(null)})
    adj, ranks = holm([r["p"] for r in rows])
    m = len(rows)
    out = []
    for (ev, null, direction), r, pa, rank in zip(tests, rows, adj, ranks):
        lvl = 1 - alpha / (m - rank + 1)
        ci_h, se_h = (ev.interval(lvl), ev.mcse(lvl)) if ev is not None else ((math.nan,) * 2, (math.nan,) * 2)
        v_h = stats.verdict(ci_h, direction, null, se_h) if pa <= alpha else "unclear"
        out.append({"interval": ev.kind if ev is not None else None,
                    "ci_low": r["ci"][0], "ci_high": r["ci"][1], "mcse_low": r["mcse"][0],
                    "mcse_high": r["mcse"][1],
                    "verdict_unadjusted": stats.verdict(r["ci"], direction, null, r["mcse"]),
                    "p_value": r["p"], "p_holm": pa, "holm_level": lvl, "ci_low_holm": ci_h[0],
                    "ci_high_holm": ci_h[1], "mcse_low_holm": se_h[0], "mcse_high_holm": se_h[1],
                    "verdict": v_h})
    return out
