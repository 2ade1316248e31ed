"""Statistics against known answers: bootstrap intervals on constructed cases, the verdict rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deltalens.analysis import stats
from deltalens.errors import DeltalensError


def test_constant_shift_gives_a_point_interval():
    base = np.tile(np.linspace(0, 1, 50), (3, 1))
    eff = stats.paired_effect(base + 0.1, base)
    assert eff["estimate"] == pytest.approx(0.1)
    assert eff["ci"] == pytest.approx([0.1, 0.1]) and eff["ci_problems"] == pytest.approx([0.1, 0.1])


def test_problem_interval_matches_the_normal_approximation():
    rng = np.random.default_rng(1)
    d = rng.normal(0.05, 0.2, 2000)  # per-problem differences with a known mean and spread
    lo, hi = stats.problem_bootstrap(d[None, :], np.zeros((1, 2000)), resamples=4000)
    se = 0.2 / np.sqrt(2000)
    assert (lo + hi) / 2 == pytest.approx(d.mean(), abs=0.2 * se)
    assert hi - lo == pytest.approx(2 * 1.96 * d.std() / np.sqrt(2000), rel=0.1)


def test_seed_spread_widens_the_hierarchical_interval():
    rng = np.random.default_rng(0)
    base = rng.random((1, 400))
    # three training seeds that disagree: +0.1, 0, -0.1 on every problem
    method = np.stack([base[0] + s for s in (0.1, 0.0, -0.1)])
    problems_only = stats.problem_bootstrap(method, base)
    both = stats.hierarchical_bootstrap(method, base)
    assert problems_only[1] - problems_only[0] < 1e-9  # averaged over seeds every difference is 0
    assert both[0] < -0.05 and both[1] > 0.05  # resampling seeds shows the runs disagree
    assert stats.verdict(both, +1) == "unclear"
    assert stats.paired_effect(method, base)["per_seed"] == pytest.approx([0.1, 0.0, -0.1])  # each seed's effect


def test_two_seeds_that_disagree_give_the_t_interval_over_seeds():
    # seeds at +a and -a on every problem: no problem spread, seed effects' se = a, so the interval is
    # a * t_1 quantiles = +-12.706 a (Monte Carlo over 20000 replicates: ~4%)
    a = 0.01
    method = np.stack([np.full(50, 0.5 + a), np.full(50, 0.5 - a)])
    lo, hi = stats.hierarchical_bootstrap(method, np.full((1, 50), 0.5), resamples=200_000)
    assert lo == pytest.approx(-12.706 * a, rel=0.05) and hi == pytest.approx(12.706 * a, rel=0.05)  # MC ~1.4%


def test_span_clips_an_interval_the_metric_cannot_reach():
    # two seeds at 0.1 and 0.9 on every problem against a base at 0.1: t_1 reaches far past +-1
    method = np.stack([np.full(40, 0.1), np.full(40, 0.9)])
    base = np.full((1, 40), 0.1)
    lo, hi = stats.hierarchical_bootstrap(method, base)
    assert lo < -1 and hi > 1
    assert stats.hierarchical_bootstrap(method, base, span=1.0) == (-1.0, 1.0)
    assert stats.paired_effect(method, base, span=1.0)["ci"] == [-1.0, 1.0]


def test_the_base_sampling_seeds_get_no_seed_part_unless_the_base_is_trained():
    # the base's seeds at +a and -a on every problem, the method (one seed) 0.1 above their mean everywhere
    a = 0.01
    base = np.stack([np.full(50, 0.5 + a), np.full(50, 0.5 - a)])
    method = np.full((1, 50), 0.6)
    assert stats.hierarchical_bootstrap(method, base) == pytest.approx((0.1, 0.1))  # sampling seeds: no shift
    lo, hi = stats.hierarchical_bootstrap(method, base, trained_base=True, resamples=200_000)  # two training runs
    assert 0.1 - lo == pytest.approx(12.706 * a, rel=0.05) and hi - 0.1 == pytest.approx(12.706 * a, rel=0.05)
    assert stats.paired_effect(method, base, trained_base=True)["ci"][0] < 0


def test_seeds_that_do_not_differ_add_little_width():
    # 2 seeds whose per-problem noise (sd 0.2) is the only difference: the ANOVA step takes that noise out of
    # the seed part (it is in the problem part already); counting it twice made the median width 3.7x
    rng = np.random.default_rng(2)
    ratios = []
    for t in range(100):
        b_i = rng.random(100)
        base, method = b_i + rng.normal(0, 0.2, (3, 100)), b_i + 0.03 + rng.normal(0, 0.2, (2, 100))
        lo, hi = stats.hierarchical_bootstrap(method, base, resamples=500, seed=t)
        plo, phi = stats.problem_bootstrap(method, base, resamples=500, seed=t)
        ratios.append((hi - lo) / (phi - plo))
    assert np.median(ratios) < 1.5


@pytest.mark.parametrize("n_seeds", [2, 3])
def test_hierarchical_interval_covers_the_truth_when_seeds_differ(n_seeds):
    # training seeds shift every problem by N(0, 0.05), far more than the 200 problems' own noise: resampling
    # 2-3 seeds covered the truth 54% / 74% of the time (benchmarks/bench_stats_coverage.py); the t draw ~95%
    rng = np.random.default_rng(11)
    hits, trials = 0, 200
    for t in range(trials):
        b_i = rng.random(200)
        base = b_i + rng.normal(0, 0.02, (2, 200))
        method = b_i + 0.03 + rng.normal(0, 0.05, (n_seeds, 1)) + rng.normal(0, 0.02, (n_seeds, 200))
        lo, hi = stats.hierarchical_bootstrap(method, base, resamples=500, seed=t)
        hits += lo <= 0.03 <= hi
    assert 0.89 <= hits / trials <= 0.995


def test_hierarchical_interval_covers_the_truth():
    rng = np.random.default_rng(3)
    hits = 0
    for trial in range(40):
        truth = 0.03
        base = rng.random((2, 300)) < 0.4
        method = rng.random((3, 300)) < 0.4 + truth
        lo, hi = stats.hierarchical_bootstrap(method.astype(float), base.astype(float), resamples=600, seed=trial)
        hits += lo <= truth <= hi
    assert hits >= 34  # ~95% coverage, with room for 40 trials


def test_verdict_rule():
    assert stats.verdict((0.01, 0.05), +1) == "reproduced"
    assert stats.verdict((0.01, 0.05), -1) == "contradicted"
    assert stats.verdict((-0.05, -0.01), -1) == "reproduced"
    assert stats.verdict((-0.05, 0.01), -1) == "unclear"
    assert stats.verdict((1.5, 3.0), +1, null=1.0) == "reproduced"
    assert stats.verdict((0.5, 3.0), +1, null=1.0) == "unclear"
    # a bound that is the null up to float rounding touches it (the SmolLM2 study's GRPO Pass@32 interval)
    assert stats.verdict((4.44e-18, 0.213), -1) == "unclear" and stats.verdict((-0.2, -3e-17), +1) == "unclear"
    assert stats.verdict((1e-6, 0.2), -1) == "contradicted"
    assert "paper's side of the null" in stats.rule_text()


def test_seed_interval_known_answer_and_errors():
    assert all(math.isnan(x) for x in stats.seed_interval([10.7]))  # one seed: no interval
    assert stats.verdict(stats.seed_interval([10.7]), +1, null=1.0) == "unclear"
    # mean 11, s = 1, t_{0.975, 2} = 4.302653: half-width 4.302653 / sqrt(3) = 2.484138
    assert stats.seed_interval([10.0, 11.0, 12.0]) == pytest.approx((8.515862, 13.484138), abs=1e-6)
    assert stats.seed_interval([3.0, 3.0]) == (3.0, 3.0)
    with pytest.raises(DeltalensError, match="finite"):
        stats.seed_interval([1.0, math.inf])
    assert all(math.isnan(x) for x in stats.mean_bootstrap([0.2]))
    assert stats.mean_bootstrap([0.2, 0.2, 0.2]) == (0.2, 0.2)
    lo, hi = stats.mean_bootstrap(np.linspace(0, 1, 41), resamples=4000)
    assert lo == pytest.approx(0.5 - 1.96 * np.linspace(0, 1, 41).std() / math.sqrt(41), abs=0.015)
    assert hi == pytest.approx(0.5 + 1.96 * np.linspace(0, 1, 41).std() / math.sqrt(41), abs=0.015)
    with pytest.raises(DeltalensError, match="same problems"):
        stats.hierarchical_bootstrap(np.zeros((1, 3)), np.zeros((1, 4)))
    with pytest.raises(DeltalensError, match="finite"):
        stats.paired_effect([[np.nan, 1.0]], [[0.0, 1.0]])
    t = stats.table([{"claim": 1, "check": "x", "verdict": "unclear"}])
    assert t.columns[0] == "claim" and t.iloc[0]["verdict"] == "unclear"


@pytest.mark.parametrize("n, boot_cover", [(2, 0.50), (3, 0.75)])
def test_seed_interval_covers_95_percent_where_a_bootstrap_of_few_seeds_does_not(n, boot_cover):
    # 3000 studies of n seeds, per-seed values N(5, 1): the t interval holds the true mean 95% of the time
    # (Monte Carlo s.e. 0.004); the percentile bootstrap of n values is [min, max], which holds it with
    # probability 1 - 2 / 2**n (0.50 for 2 seeds, 0.75 for 3)
    rng = np.random.default_rng(7)
    draws = rng.normal(5.0, 1.0, (3000, n))
    t_hit = np.mean([lo <= 5.0 <= hi for lo, hi in map(stats.seed_interval, draws)])
    b_hit = np.mean([lo <= 5.0 <= hi for lo, hi in (stats.mean_bootstrap(d, resamples=400, seed=i)
                                                    for i, d in enumerate(draws[:600]))])
    assert abs(t_hit - 0.95) < 0.015
    assert abs(b_hit - boot_cover) < 0.06


def test_gain_ratio_known_answer():
    base = np.zeros((1, 200))
    ref = np.full((2, 200), 0.4)
    est, ci = stats.gain_ratio(np.full((2, 200), 0.3), ref, base, resamples=300)
    assert est == pytest.approx(0.75) and ci == pytest.approx((0.75, 0.75))
    assert stats.verdict(ci, +1, null=0.5) == "reproduced"
    # two runs of the reference at 0.3 and 0.5: its seed part widens the share's interval (t_1)
    est, ci = stats.gain_ratio(np.full((1, 200), 0.3), np.stack([np.full(200, 0.3), np.full(200, 0.5)]), base,
                               resamples=2000)
    assert est == pytest.approx(0.75) and ci[0] < 0.5 and ci[1] > 1.0
    est, ci = stats.gain_ratio(np.full((1, 200), 0.3), base, base, resamples=300)  # no gain to keep a share of
    assert np.isnan(est) and stats.verdict(ci, +1, null=0.5) == "unclear"
