"""Claim 7's mechanism: the paired-reward correlation of two-point ES runs, from their metrics rows (R+ of
member 0, R- of its mirror), pooled within runs, with a bootstrap over iterations; shown in claim 7's
section, Holm-adjusted, not part of the claim's verdict."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from deltalens.errors import DeltalensError
from deltalens.study.checks import adjust, check, paired_reward_stats, paired_rewards, two_point_checks
from deltalens.study.claims import claims_of

TWO_POINT = {"method": "es", "population": 2, "antithetic": True, "prompts_per_iteration": 4}


def _run(tmp_path, name, pairs, config=TWO_POINT, extra_rows=()):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    rows = [{"iteration": 0, "eval": {"pass_at_1": 0.2}}, *extra_rows,
            *({"iteration": i, "reward_mean": (a + b) / 2, "rewards": [a, b]} for i, (a, b) in enumerate(pairs, 1))]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


A = [(0.1, 0.2), (0.3, 0.2), (0.5, 0.6), (0.7, 0.6)]  # centred: R+ -.3 -.1 .1 .3, R- -.2 -.2 .2 .2
B = [(0.0, 0.3), (0.4, 0.1), (0.2, 0.2)]  # centred: R+ -.2 .2 0, R- .1 -.1 0


def test_known_answer_on_constructed_rows(tmp_path):
    runs = {"es-2pt-s0": _run(tmp_path, "a", A), "es-2pt-s1": _run(tmp_path, "b", B)}
    (c,) = two_point_checks(runs, 1000)
    # pooled within runs: Sxy = .16 - .04, Sxx = .2 + .08, Syy = .16 + .02, df = (4 - 1) + (3 - 1)
    assert c["claim"] == 7 and c["metric"] == "corr(R+, R-)" and c["direction"] == "+" and c["null"] == 0.0
    assert c["estimate"] == pytest.approx(0.12 / math.sqrt(0.28 * 0.18))
    assert c["covariance"] == pytest.approx(0.12 / 5)
    assert c["variance_ratio"] == pytest.approx(1 - 2 * 0.12 / 0.46)  # Var(R+ - R-) / (Var R+ + Var R-)
    assert c["per_seed"] == pytest.approx([0.16 / math.sqrt(0.2 * 0.16), -1.0])  # each run's own correlation
    # the paired differences R+ - R-: -.1 .1 -.1 .1 and -.3 .3 0
    assert c["paired_difference_mean"] == pytest.approx(0.0, abs=1e-12)
    assert c["paired_difference_sd"] == pytest.approx(math.sqrt(0.22 / 6))
    assert (c["iterations"], c["runs"], c["in_verdict"], c["seed_spread"]) == (7, 2, False, False)
    assert c["pairs"]["es-2pt-s1"] == [list(p) for p in B]  # the data it was computed from, in analysis.json
    assert c["ci_low"] <= c["estimate"] <= c["ci_high"]
    lo, hi = c["covariance_ci"]
    assert lo <= c["covariance"] <= hi


def test_pairs_come_from_the_rows_in_order_each_iteration_once():
    rows = [{"iteration": 0, "eval": {}}, {"iteration": 2, "rewards": [0.5, 0.1]},
            {"iteration": 1, "rewards": [0.9, 0.9]}, {"iteration": 1, "rewards": [0.3, 0.4]}]  # 1 re-logged
    assert paired_rewards(rows) == [(0.3, 0.4), (0.5, 0.1)]
    with pytest.raises(DeltalensError, match="3 member rewards; a two-point run has 2"):
        paired_rewards([{"iteration": 1, "rewards": [0.1, 0.2, 0.3]}])


def _series(rho, n, seed):
    """n pairs with correlation rho: a shared part (the iteration's prompts) and each member's own."""
    rng = np.random.default_rng(seed)
    shared, own = rng.normal(size=n), rng.normal(size=(n, 2))
    x = 0.5 + 0.1 * (math.sqrt(abs(rho)) * shared + math.sqrt(1 - abs(rho)) * own[:, 0])
    y = 0.5 + 0.1 * (math.copysign(math.sqrt(abs(rho)), rho) * shared + math.sqrt(1 - abs(rho)) * own[:, 1])
    return list(zip(x.tolist(), y.tolist()))


def test_the_verdict_follows_the_sign_and_is_seeded(tmp_path):
    pos = {"s0": _series(0.8, 60, 0), "s1": _series(0.8, 60, 1)}
    neg = {"s0": _series(-0.8, 60, 2)}
    none = {"s0": _series(0.0, 60, 3)}
    a, b = paired_reward_stats(pos, 2000), paired_reward_stats(pos, 2000)
    assert np.array_equal(a["replicates"]["corr"], b["replicates"]["corr"])  # seeded: the same draws
    assert 0.65 < a["corr"] < 0.95 and a["ratio"] == pytest.approx(1 - a["corr"], abs=0.05)
    verdicts = {}
    for name, pairs in (("pos", pos), ("neg", neg), ("none", none)):
        d = tmp_path / name
        d.mkdir()
        runs = {label: _run(d, label, p) for label, p in pairs.items()}
        verdicts[name] = adjust(two_point_checks(runs, 2000))[0]["verdict"]
    assert verdicts == {"pos": "reproduced", "neg": "contradicted", "none": "unclear"}


def test_shown_in_claim_7_but_not_its_verdict(tmp_path):
    cov = two_point_checks({"s0": _run(tmp_path, "neg", _series(-0.8, 60, 2))}, 2000)
    no_advantage = check(7, "two-point es (N=2) minus es, Pass@1: no advantage", "es-2pt", "pass@1", -0.05,
                         (-0.08, -0.02), -1, null=0.02)
    adjust(cov + [no_advantage])
    assert cov[0]["verdict"] == "contradicted" and no_advantage["verdict"] == "unclear"  # no evidence: unclear
    (seven,) = [c for c in claims_of(cov + [no_advantage]) if c["id"] == 7]
    assert len(seven["checks"]) == 2 and seven["verdict"] == "unclear"  # the correlation's verdict is not counted


def test_too_few_iterations_or_not_two_point(tmp_path):
    (c,) = two_point_checks({"s0": _run(tmp_path, "short", [(0.1, 0.2)])}, 200)
    assert math.isnan(c["estimate"]) and c["_evidence"] is None  # one pair: untestable, shown as such
    with pytest.raises(DeltalensError, match="is not a two-point run"):
        two_point_checks({"es-s0": _run(tmp_path, "es", A, {**TWO_POINT, "population": 4})}, 200)


def test_the_check_is_valid_in_analysis_json(tmp_path):
    """The check goes into analysis.json as it is: its fields must match the schema's check item (`runs` a
    count, `pairs` a mapping run -> pairs); a mismatch made every --two-point study's document invalid."""
    import jsonschema

    from deltalens.schema import schema

    root = schema()
    item = root["$defs"]["study"]["properties"]["claims"]["items"]["properties"]["checks"]["items"]
    (c,) = adjust(two_point_checks({"es-2pt-s0": _run(tmp_path, "a", A), "es-2pt-s1": _run(tmp_path, "b", B)}, 200))
    jsonschema.validate(json.loads(json.dumps(c)), {"$defs": root["$defs"], **item})
