"""Issue #34's statistics against known answers: Holm on constructed p-values and intervals, bootstrap
p-values, Monte Carlo SE of a percentile bound, Fieller's interval of a ratio, non-inferiority, problems
lost, and the study's claim-1 checks and summary from one base definition."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from deltalens.reports.markdown import study_markdown
from scipy import stats as sps

from deltalens.analysis import multiplicity as mu
from deltalens.analysis import stats
from deltalens.errors import DeltalensError
from deltalens.schema import validate
from deltalens.study import checks as study_checks
from deltalens.study import claims as study_claims
from deltalens.study.config import StudyConfig

# ------------------------------------------------------------------------------------------------ Holm


def test_holm_adjusted_p_values_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 -> 4 * 0.005 = 0.02, 3 * 0.01 = 0.03, 2 * 0.03 = 0.06, max(1 * 0.04, 0.06)
    adj, ranks = mu.holm([0.01, 0.04, 0.03, 0.005])
    assert adj == pytest.approx([0.03, 0.06, 0.06, 0.02]) and ranks == [2, 4, 3, 1]
    # Holm rejects what Bonferroni (0.05 / 2 = 0.025) does not: the second step tests 0.03 at 0.05
    adj, _ = mu.holm([0.001, 0.03])
    assert adj == pytest.approx([0.002, 0.03])
    assert mu.holm([0.2, 0.2, 0.01])[1] == [2, 2, 1]  # ties share the smallest rank
    assert mu.holm([]) == ([], [])
    with pytest.raises(DeltalensError, match="p-values"):
        mu.holm([0.5, math.nan])


def test_holm_on_constructed_intervals():
    # three normal estimates 3.0, 2.2, 2.1 SEs above 0: two-sided p 0.0026998, 0.027807, 0.035729 (tables);
    # each excludes 0 at 95%, Holm keeps only the first: 3 * 0.0027 = 0.0081; 2 * 0.0278 = 0.0556 > 0.05
    tests = [(mu.TStat(z, 1.0, math.inf), 0.0, +1) for z in (3.0, 2.2, 2.1)]
    res = mu.judge(tests)
    assert [r["p_value"] for r in res] == pytest.approx([0.0026998, 0.027807, 0.035729], abs=2e-6)
    assert [r["p_holm"] for r in res] == pytest.approx([0.0080993, 0.055614, 0.055614], abs=5e-6)
    assert [r["verdict_unadjusted"] for r in res] == ["reproduced"] * 3
    assert [r["verdict"] for r in res] == ["reproduced", "unclear", "unclear"]
    # the levels Holm tests them at: 1 - 0.05/3, 1 - 0.05/2, 0.95; z_{1 - 0.05/6} = 2.393980
    assert [r["holm_level"] for r in res] == pytest.approx([1 - 0.05 / 3, 0.975, 0.95])
    assert (res[0]["ci_low_holm"], res[0]["ci_high_holm"]) == pytest.approx((3 - 2.393980, 3 + 2.393980), abs=1e-5)
    assert (res[2]["ci_low_holm"], res[2]["ci_high_holm"]) == pytest.approx((2.1 - 1.959964, 2.1 + 1.959964),
                                                                             abs=1e-5)
    assert res[2]["ci_low"] == res[2]["ci_low_holm"]  # the last step is the unadjusted interval
    # the other side: an estimate 4 SEs below 0 for a check the paper says raises is contradicted
    res = mu.judge([(mu.TStat(-4.0, 1.0, math.inf), 0.0, +1), (None, 0.0, +1)])
    assert res[0]["verdict"] == "contradicted" and res[1]["verdict"] == "unclear" and res[1]["p_value"] == 1.0
    assert res[0]["p_holm"] == pytest.approx(2 * 2 * sps.norm.sf(4.0))  # the untestable check counts in m


def test_bootstrap_p_value_has_the_plus_one_correction():
    reps = np.concatenate([np.full(4, -1.0), np.linspace(0.1, 1.0, 95)])  # R = 99, 4 at or below 0
    assert mu.Replicates(reps).p_value(0.0) == pytest.approx(2 * 5 / 100)
    assert mu.Replicates(np.linspace(0.1, 1.0, 99)).p_value(0.0) == pytest.approx(2 / 100)  # never 0
    assert mu.Replicates(np.zeros(99)).p_value(0.0) == 1.0  # replicates at the null count on both sides
    assert mu.Replicates(np.full(99, 4.4e-18)).p_value(0.0) == 1.0  # float rounding of the null


# --------------------------------------------------------------------------------------- Monte Carlo SE


def _normal_mcse(q: float, r: int) -> float:
    return math.sqrt(q * (1 - q) / r) / sps.norm.pdf(sps.norm.ppf(q))  # sqrt(q(1-q)/R) / f(x_q)


def test_mcse_of_a_quantile_matches_the_order_statistic_answer_and_shrinks_like_one_over_sqrt_r():
    rng = np.random.default_rng(0)
    q = 0.025
    for r in (4000, 16000):  # 2.671 / sqrt(R) for the 2.5% quantile of N(0, 1); the mean of 40: ~2% noise
        est = np.mean([mu.quantile_mcse(rng.standard_normal(r), q) for _ in range(40)])
        assert est == pytest.approx(_normal_mcse(q, r), rel=0.08)
    small = np.mean([mu.quantile_mcse(rng.standard_normal(2000), q) for _ in range(40)])
    large = np.mean([mu.quantile_mcse(rng.standard_normal(32000), q) for _ in range(40)])
    assert small / large == pytest.approx(4.0, rel=0.1)  # 16x the replicates: a quarter of the error
    with pytest.raises(DeltalensError, match="replicates"):
        mu.quantile_mcse([1.0], 0.5)


def test_mcse_predicts_how_much_a_bootstrap_bound_moves_between_reruns():
    # an independent check: the SD of the hierarchical 2.5% bound over 60 bootstrap seeds, against the mean SE
    rng = np.random.default_rng(4)
    base = rng.random((2, 120))
    method = base.mean(0) + 0.03 + rng.normal(0, 0.05, (2, 1)) + rng.normal(0, 0.1, (2, 120))
    reps = [mu.Replicates(stats.hierarchical_replicates(method, base, resamples=2000, seed=s)) for s in range(60)]
    bounds = [r.interval(0.95)[0] for r in reps]
    ses = [r.mcse(0.95)[0] for r in reps]
    assert np.mean(ses) == pytest.approx(np.std(bounds, ddof=1), rel=0.3)


def test_a_bound_within_two_monte_carlo_ses_of_the_null_is_unclear():
    # the tiny study's ES Pass@16: lower bound 8.05e-5 with a Monte Carlo SD of ~2.5e-4
    assert stats.verdict((8.05e-5, 0.05), +1) == "reproduced"
    assert stats.verdict((8.05e-5, 0.05), +1, mcse=(2.5e-4, 1e-3)) == "unclear"
    assert stats.verdict((8.05e-5, 0.05), +1, mcse=(1e-5, 1e-3)) == "reproduced"
    assert stats.verdict((-0.05, -8e-5), +1, mcse=(0.0, 5e-5)) == "unclear"  # the upper bound too
    # through judge: replicates whose 2.5% point sits 1 replicate-step above 0 in a sparse tail
    reps = np.concatenate([np.linspace(0.0001, 0.002, 55), np.linspace(0.1, 0.2, 1945)])
    res = mu.judge([(mu.Replicates(reps), 0.0, +1)])[0]
    assert res["ci_low"] > 0 and res["mcse_low"] > res["ci_low"] / 2
    assert res["verdict_unadjusted"] == "unclear" and res["verdict"] == "unclear"


# ---------------------------------------------------------------------------------------------- Fieller


def _pivot_roots(a, g, va, vg, c, t):
    """Fieller's bounds found independently: bisection of (A - rho G)^2 - t^2 var(A - rho G) on each side."""
    f = lambda r: (a - r * g) ** 2 - t * t * (va - 2 * r * c + r * r * vg)
    out = []
    for lo, hi in ((-50.0, a / g), (a / g, 50.0)):
        for _ in range(200):
            mid = (lo + hi) / 2
            if (f(mid) > 0) == (f(lo) > 0):
                lo = mid
            else:
                hi = mid
        out.append((lo + hi) / 2)
    return out


def test_fieller_interval_known_answer():
    # A = 0.3, G = 0.5, vA = vG = 0.01, cov 0.005, normal: quadratic a = 0.25 - 3.841459 * 0.01 = 0.2115854,
    # b = 0.15 - 3.841459 * 0.005 = 0.1307927, c0 = 0.09 - 0.0384146 = 0.0515854 -> roots (b -+ sqrt(b^2 - a c0)) / a
    ev = mu.Fieller(0.3, 0.5, 0.01, 0.01, 0.005, math.inf)
    lo, hi = ev.interval(0.95)
    assert (lo, hi) == pytest.approx((0.246252, 0.990059), abs=1e-6)
    assert [lo, hi] == pytest.approx(_pivot_roots(0.3, 0.5, 0.01, 0.01, 0.005, 1.959964), abs=1e-6)
    assert ev.estimate == pytest.approx(0.6) and (hi - 0.6) > (0.6 - lo)  # not symmetric, unlike the delta method
    # the interval inverts the test: at its bounds the pivot's p-value is exactly 1 - level
    assert ev.p_value(lo) == pytest.approx(0.05, abs=1e-6) and ev.p_value(hi) == pytest.approx(0.05, abs=1e-6)
    assert mu.Fieller(0.3, 0.5, 0, 0, 0, math.inf).interval(0.95) == pytest.approx((0.6, 0.6))
    # a gain not significantly above 0 (G^2 < t^2 vG): the set is unbounded, reported undefined
    assert all(math.isnan(x) for x in mu.Fieller(0.3, 0.1, 0.01, 0.01, 0.0, math.inf).interval(0.95))
    assert all(math.isnan(x) for x in mu.Fieller(0.3, -0.5, 0.01, 0.0001, 0.0, math.inf).interval(0.95))


def test_fieller_share_from_tables_by_hand():
    # one seed each on 4 problems, base 0: a_i = 0, .2, .4, .2 (mean .2), g_i = .4, .4, .8, .4 (mean .5);
    # var(a)/4 = (0.08 / 3) / 4, var(g)/4 = (0.12 / 3) / 4, cov/4 = (0.08 / 3) / 4; df = 3
    est, ev = mu.fieller_share([[0, 0.2, 0.4, 0.2]], [[0.4, 0.4, 0.8, 0.4]], [[0, 0, 0, 0]])
    assert est == pytest.approx(0.4)
    assert (ev.a, ev.g, ev.va, ev.vg, ev.cov, ev.df) == pytest.approx((0.2, 0.5, 0.08 / 12, 0.12 / 12, 0.08 / 12, 3))
    assert list(ev.interval(0.95)) == pytest.approx(
        _pivot_roots(0.2, 0.5, 0.08 / 12, 0.12 / 12, 0.08 / 12, sps.t.ppf(0.975, 3)), abs=1e-6)
    # two reference runs at 0.3 and 0.5 on every problem: their seed part (t_1) leaves the gain unsure, so the
    # share is undefined (the percentile ratio of `gain_ratio` reports an interval here)
    est, ev = mu.fieller_share(np.full((1, 200), 0.3), np.stack([np.full(200, 0.3), np.full(200, 0.5)]),
                               np.zeros((1, 200)))
    assert est == pytest.approx(0.75) and ev.vg == pytest.approx(0.01) and ev.df == pytest.approx(1.0)
    assert all(math.isnan(x) for x in ev.interval(0.95))
    assert stats.verdict(ev.interval(0.95), +1, null=0.5) == "unclear"


def test_fieller_covers_the_true_ratio_95_percent():
    # A, G normal around 0.3, 0.4 with a correlation; 2000 draws, the interval holds 0.75 ~95% (MC SE 0.005)
    rng = np.random.default_rng(9)
    va, vg, c = 0.002, 0.003, 0.0012
    draws = rng.multivariate_normal([0.3, 0.4], [[va, c], [c, vg]], 2000)
    hits = [lo <= 0.75 <= hi for lo, hi in (mu.Fieller(a, g, va, vg, c, math.inf).interval(0.95) for a, g in draws)]
    assert abs(np.mean(hits) - 0.95) < 0.015


# --------------------------------------------------------------------------------- non-inferiority, lost


def test_non_inferiority_against_a_margin():
    base = np.tile(np.linspace(0.2, 0.9, 50), (3, 1))
    keeps = mu.Replicates(stats.hierarchical_replicates(base[:1] - 0.01, base, resamples=2000))  # 0.01 lower
    # "raises" is contradicted (the interval is [-0.01, -0.01]); "keeps" at margin 0.02 is reproduced
    assert mu.judge([(keeps, 0.0, +1)])[0]["verdict"] == "contradicted"
    assert mu.judge([(keeps, -0.02, +1)])[0]["verdict"] == "reproduced"
    worse = mu.Replicates(stats.hierarchical_replicates(base[:1] - 0.03, base, resamples=2000))
    assert mu.judge([(worse, -0.02, +1)])[0]["verdict"] == "contradicted"  # worse by more than the margin
    assert "-0.02 (the margin)" in stats.rule_text(0.02) and "(the margin)" not in stats.rule_text()
    with pytest.raises(DeltalensError, match="noninferiority-margin"):
        StudyConfig(model="tiny", task="arith", noninferiority_margin=-0.1)


def test_problems_lost_known_count():
    # base rates over 2 sampling seeds: problem 0 at 4/32 and 4/32 (eligible), 1 at 3/32 and 5/32 (mean 4/32:
    # eligible), 2 at 3/32 and 4/32 (mean 3.5/32: not), 3 at 32/32
    base = np.array([[4, 3, 3, 32], [4, 5, 4, 32]]) / 32
    runs = np.array([[1, 0, 0, 30],  # drops 0 and 1 to <= 1 of 32; problem 2 is not the base's
                     [2, 1, 0, 1]])  # drops 1 and 3; 2 correct on problem 0 is kept
    res = stats.problems_lost(base, runs)
    assert res["eligible"].tolist() == [0, 1, 3] and res["per_seed"] == [2, 2]
    assert res["lost"].tolist() == [[1, 1, 0], [0, 1, 1]]
    assert stats.problems_lost(base, runs, base_at_least=0.5)["per_seed"] == [0, 1]
    with pytest.raises(DeltalensError, match="same problems"):
        stats.problems_lost(base, runs[:, :3])


# ------------------------------------------------------------------ the study's checks, one base definition


def _ev(counts, n=32):
    return {"per_problem": [{"n": n, "correct": int(c), "maj_at_k": {"16": float(c >= 16), "32": float(c >= 16)}}
                            for c in counts]}


def _pass(n, c, k):  # unbiased Pass@k, written out here: 1 - C(n - c, k) / C(n, k)
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_study_checks_and_summary_share_one_base_and_are_holm_adjusted():
    p = 40
    base_c = np.array([(i % 10) * 3 for i in range(p)])  # 0..27 of 32; rate >= 4/32 from i % 10 >= 2: 32 problems
    jitter = (base_c >= 3).astype(int)  # sampling seeds differ by one correct sample where the base solves some
    base_evals = [_ev(base_c), _ev(base_c + jitter), _ev(base_c - jitter)]
    grpo = []
    for drop in ({2, 3, 4, 5}, {12, 13, 14}, set()):  # 4 / 3 / 0 problems lost, as in the SmolLM2 study
        c = np.minimum(32, base_c + 6)
        c[list(drop)] = 1 if len(drop) == 3 else 0
        c[1] = 0  # the base solves problem 1 at 3/32 (mean of 3, 4, 2): not one it loses
        grpo.append(c)
    evals = {"grpo": [_ev(c) for c in grpo], "es": [_ev(base_c + 2) for _ in range(3)]}
    cfg = StudyConfig(model="tiny", task="arith", methods=("es", "grpo"), seeds=(0, 1, 2), noninferiority_margin=0.02)
    checks, effects = study_checks.evaluation_checks(cfg, base_evals, evals, 2000)
    summary = study_checks.effects_summary(effects)
    for k in (1, 16, 32):  # the base of every summary row and check: the mean over the 3 sampling seeds
        base_k = np.mean([[_pass(32, r["correct"], k) for r in ev["per_problem"]] for ev in base_evals])
        for meth in ("es", "grpo"):
            assert summary[f"{meth}:pass@{k}"]["base"] == pytest.approx(base_k)
    for c in checks:
        if c["metric"].startswith("pass@"):
            s = summary[f"{c['method']}:{c['metric']}"]
            assert (c["base_value"], c["estimate"], [c["ci_low"], c["ci_high"]]) == (s["base"], s["estimate"], s["ci"])
    by = {c["check"]: c for c in checks}
    keeps = by["es vs base, Pass@16: keeps (non-inferior, margin 0.02)"]
    assert keeps["null"] == -0.02 and keeps["direction"] == "+"
    lost = by["grpo: problems lost per run (base solves >= 4/32, the run <= 1/32)"]
    assert lost["per_seed"] == [4, 3, 0] and lost["eligible"] == 32 and lost["estimate"] == pytest.approx(7 / 3)
    assert (lost["ci_low"], lost["ci_high"]) == pytest.approx(stats.seed_interval([4, 3, 0]))
    vs = by["problems lost, grpo minus es (share of the 32 the base solves)"]
    assert vs["estimate"] == pytest.approx(7 / 96) and vs["lost_es"] == [0, 0, 0]

    study_checks.adjust(checks)
    m = len(checks)
    assert all("_evidence" not in c for c in checks)
    for c in checks:
        assert c["verdict"] == "unclear" or c["p_holm"] <= 0.05
        assert c["holm_level"] in [pytest.approx(1 - 0.05 / (m - r)) for r in range(m)]
    assert keeps["verdict"] == "reproduced"  # ES 2 samples above the base everywhere: well above -0.02
    assert keeps["ci_low"] > 0 and keeps["mcse_low"] > 0  # a bootstrap bound has Monte Carlo error
    assert by["es vs base, Pass@1"]["verdict"] == "reproduced"
    assert lost["verdict_unadjusted"] == "unclear" and lost["mcse_low"] == 0.0  # t_2 over 4, 3, 0 reaches below 0
    assert lost["interval"] == "t" and keeps["interval"] == "bootstrap"
    assert lost["seed_spread"] and lost["p_value"] == pytest.approx(2 * sps.t.sf((7 / 3) / (np.std([4, 3, 0], ddof=1)
                                                                                            / math.sqrt(3)), 2))
    # the document: valid, JSON without NaN, the tables show Holm's verdict beside the unadjusted interval
    study = {"rule": stats.rule_text(0.02) + " " + study_claims.SEED_SPREAD,
             "claims": [{"id": 1, "title": study_claims.CLAIMS[1], "verdict": study_checks.claim_verdict(checks),
                         "checks": checks}]}
    doc = json.loads(json.dumps({"schema_version": 1, "deltalens_version": "0", "created": "2026-12-01T00:00:00Z",
                                 "models": [], "study": study}, default=float))
    validate(doc)
    md = study_markdown(doc)
    assert "| 95% interval (unadjusted) | MC SE of bounds | Holm interval | p (Holm) |" in md
    assert "claims 3, 9 and 10 measure the first seed's runs only" in md
    row = next(x for x in md.splitlines() if x.startswith("|  | es vs base, Pass@16: keeps"))
    assert row.endswith("| + vs -0.02 | reproduced | reproduced |") and "analytic" not in row
