"""The estimators of population diversity: pure formulas on log-probabilities and success counts.

For N policies π_1..π_N (an ES population θ_i = θ + σ ε_i, Qiu et al., arXiv 2509.24372) and one prompt x:

Policy JS over whole responses y (prompt excluded, EOS included), the N-member (generalised) Jensen-Shannon
divergence, which is the mutual information between a uniformly drawn member index and its response:
    JS(x) = (1/N) Σ_i KL(π_i(·|x) || π̄(·|x)),   π̄ = (1/N) Σ_j π_j        (nats, at most log N)
          = E_{y~π̄}[log N − H(w(y))],           w_j(y) = π_j(y) / Σ_k π_k(y) (posterior over members)
It is not the mean of the pairwise JS(π_i, π_j) over member pairs (a different, smaller-scale number).

From M responses y_im ~ π_i of every member, each scored under every member by teacher forcing
(logp[j, i, m] = log π_j(y_im)), two Monte Carlo estimates of the same JS (`js_from_logprobs`):
- direct: mean over i, m of log π_i(y_im) − log π̄(y_im);
- posterior (mutual-information form): mean over i, m of log N − H(w(y_im)); the pooled samples are a
  stratified sample of π̄.
Both are unbiased: log π̄ and w are computed exactly from the scored table (nothing is a plug-in of sampled
frequencies), and the stratified pooled sample has expectation E_{π̄}. Their standard errors are over
samples, stratified by member: se = sqrt(Σ_i s_i² / M) / N with s_i² the variance of member i's M terms
(M = 1: the pooled variance of all N terms / N, which also counts between-member spread: conservative).

ESTIMATOR: the one we report is the posterior form, everywhere a JS number is shown (analysis.json's
`js_mean` / `js_se` with `"estimator": "posterior"`, the report's figure and table, the study's verdict).
Why: each of its terms is ≥ 0 and O(σ²), while a direct term is O(σ) with mean O(σ²), so the direct
estimate's relative error grows like 1/σ and it can come out negative; the posterior one's does not. On
tiny at σ = 3e-4 with N·M·P = 384 samples: direct −0.0029 ± 0.0024, posterior 0.0012 ± 0.0001 (the small-σ
law predicts 0.0013 on that noise draw). Both are unbiased, so the choice is variance, not bias. Over
prompts, the reported JS is the plain mean of the per-prompt JS (each prompt weighs the same); its `js_se`
is the Monte Carlo error with those prompts fixed (sqrt(Σ_x se_x²) / P), `js_se_prompts` the spread of
JS over prompts. The direct estimate stays in analysis.json as `js_direct_*`, a cross-check.

Verifier-projected JS: JS_succ(x) = h(p̄) − (1/N) Σ_i h(p_i), h the binary entropy (nats), p_i member i's
success rate on its M samples, p̄ = mean_i p_i. This one *is* a plug-in (of frequencies), biased upwards
for small M: identical members (σ = 0) still show sampling spread (0.075 nats on tiny with M = 4).
`js_success_null` is the permutation null, the exact expectation of the plug-in when the N·M outcomes are
shuffled across members (hypergeometric); the section reports `js_succ_corrected` = plug-in − null.

Coverage: population Pass@N with one sample per member, 1 − Π_i (1 − p_i), against the paper's bound
1 − (1 − p̄)^N (AM-GM; it holds for any p_i, so `holds` checks the arithmetic) and the centre's Pass@N.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from scipy.stats import hypergeom as sps_hypergeom

ESTIMATOR = "posterior"  # the JS estimator reported (module docstring); the other is "direct"
ESTIMATOR_LABEL = "posterior (mutual-information) estimator"  # how reports name it


def binary_entropy(p: float) -> float:
    """h(p) = −p log p − (1−p) log(1−p) in nats; h(0) = h(1) = 0."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -p * math.log(p) - (1 - p) * math.log1p(-p)


def _stratified_se(terms: torch.Tensor) -> tuple[float, str]:
    """SE of terms.mean() for terms (N members, M samples), member i's row iid from π_i."""
    n, m = terms.shape
    if m >= 2:
        return float(terms.var(dim=1, unbiased=True).sum().div(m).sqrt() / n), "stratified"
    if n >= 2:
        return float(terms.flatten().std(unbiased=True) / math.sqrt(n)), "pooled"
    return float("nan"), "none"


def js_from_logprobs(logp: torch.Tensor) -> dict:
    """JS estimates for one prompt from logp[j, i, m] = log π_j(y_im): response m of member i scored
    under member j. Shape (N, N, M); float64 recommended.

    Returns js (direct: mean_i mean_m log π_i − log π̄), js_se, js_mi (posterior-entropy form, the
    reported ESTIMATOR), js_mi_se, kl (N,) per member (direct), se_kind.
    """
    n = logp.shape[0]
    if logp.shape[1] != n:
        raise ValueError(f"logp must be (N, N, M), got {tuple(logp.shape)}")
    lse = torch.logsumexp(logp, dim=0)  # (N_i, M): log Σ_j π_j(y_im)
    own = logp.diagonal(dim1=0, dim2=1).T  # (N_i, M): log π_i(y_im)
    direct = own - (lse - math.log(n))  # (N_i, M): log π_i − log π̄
    log_w = logp - lse  # (N_j, N_i, M): log posterior of member j given y_im
    mi = math.log(n) + (log_w.exp() * log_w).sum(dim=0)  # (N_i, M): log N − H(w(y_im))
    se, kind = _stratified_se(direct)
    mi_se, _ = _stratified_se(mi)
    return {"js": float(direct.mean()), "js_se": se, "js_mi": float(mi.mean()), "js_mi_se": mi_se,
            "kl": direct.mean(dim=1).tolist(), "se_kind": kind}


def js_success(p_members: Sequence[float]) -> float:
    """Verifier-projected JS: h(p̄) − mean_i h(p_i) (JS between the members' Bernoulli(p_i))."""
    pbar = sum(p_members) / len(p_members)
    return binary_entropy(pbar) - sum(binary_entropy(p) for p in p_members) / len(p_members)


def js_success_null(successes: Sequence[int], samples: int) -> float:
    """E[js_success] for *identical* members given the pooled successes: the plug-in's bias from sampling.

    Members' success rates are frequencies over `samples` draws each, so even identical members show
    spread and h(p̄) − mean h(p̂_i) > 0. Under the permutation null (the N·M outcomes shuffled across
    members, the pooled S = Σ successes kept) a member's count is hypergeometric(N·M, S, M), so the null's
    expectation is exact: h(S/NM) − E[h(X/M)], X ~ Hypergeom. Zero when samples = 1 has no spread either.
    """
    n, m = len(successes), samples
    total, s = n * m, int(sum(successes))
    xs = range(max(0, m - (total - s)), min(m, s) + 1)
    pmf = sps_hypergeom(total, s, m).pmf(list(xs))
    return binary_entropy(s / total) - float(sum(w * binary_entropy(x / m) for w, x in zip(pmf, xs)))


def coverage(p_members: Sequence[float], p_centre: float | None = None) -> dict:
    """Pass@N of the population (one sample per member) vs the paper's bound and the centre's Pass@N.

    population = 1 − Π_i (1 − p_i); bound_rhs = 1 − (1 − p̄)^N with p̄ = mean p_i (population ≥ bound_rhs
    always, by AM-GM); centre = 1 − (1 − p_centre)^N (None without p_centre).
    """
    n = len(p_members)
    pbar = sum(p_members) / n
    population = 1.0 - math.prod(1.0 - p for p in p_members)
    rhs = 1.0 - (1.0 - pbar) ** n
    return {"population": population, "bound_rhs": rhs, "holds": population >= rhs - 1e-12,
            "centre": None if p_centre is None else 1.0 - (1.0 - p_centre) ** n}
