"""Known answers for the study's checks of claims 2, 6 and 7 on constructed inputs, each worked out by hand:

- claim 2 (`distance_checks`): the per-seed ratio of rel. L2 (ES / GRPO), its mean as the estimate and a
  Student-t interval over seeds, tested against 1 (farther), 40 (at least) and 44 (at most);
- claim 6 (`population_checks`): a population's share of the reference ES run's Pass@1 gain with its Fieller
  interval, against SCALE_FRACTION;
- claim 7 (`population_checks`, `runs.two_point_reference`): two-point ES against ES at N=16 on the same
  budget (es-n16 on a preset of another N, es on one of N=16), never the preset's N.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import scipy.stats as sps

from deltalens.study import runs as study_runs
from deltalens.study.checks import (
    SCALE_FRACTION,
    TWO_POINT_MARGIN,
    adjust,
    distance_checks,
    population_checks,
)
from deltalens.study.claims import claims_of
from deltalens.study.config import StudyConfig

T2 = 4.302652729749462  # t_{0.975} with 2 degrees of freedom (3 seeds)
T4 = 2.7764451051977987  # t_{0.975} with 4 degrees of freedom (5 problems, one seed a side)


def test_the_t_quantiles_written_here():
    assert sps.t.ppf(0.975, 2) == pytest.approx(T2) and sps.t.ppf(0.975, 4) == pytest.approx(T4)


# ------------------------------------------------------------------ claim 2: the distance ratio


def _diffs(es_l2, grpo_l2, es_comp=None, grpo_comp=None):
    """A `diffs` mapping (what the diff task writes) for seeds 0.. with these whole-model rel. L2 and top-100
    compositions (the same at both rankings)."""
    es_comp = es_comp or {"norm": 50, "attn_q": 30, "mlp": 20}
    grpo_comp = grpo_comp or {"embed": 40, "lm_head": 20, "norm": 10, "mlp": 30}
    out = {}
    for s, (e, g) in enumerate(zip(es_l2, grpo_l2)):
        for label, l2, comp in ((f"es-s{s}", e, es_comp), (f"grpo-s{s}", g, grpo_comp)):
            out[label] = {"whole": {"rel_l2": l2}, "topk": {r: {"composition": comp} for r in ("abs", "rel")}}
    return out


def _cfg(seeds=(0, 1, 2), **kw):
    return StudyConfig(model="tiny", task="arith", methods=("es", "grpo"), seeds=seeds, **kw)


def _claim2(checks):
    by = {c["null"]: c for c in checks if c["claim"] == 2}
    assert sorted(by) == [1.0, 40.0, 44.0]
    return by


def test_claim2_ratio_per_seed_with_a_t_interval_over_seeds():
    # per-seed ratios 42, 40, 44: mean 42, SD 2, so the interval is 42 -+ t_2 * 2 / sqrt(3) = [37.03, 46.97]
    checks = distance_checks(_cfg(), _diffs([0.042, 0.040, 0.044], [0.001, 0.001, 0.001]), 1000)
    by = _claim2(checks)
    half = T2 * 2 / math.sqrt(3)
    for c in by.values():
        assert c["estimate"] == pytest.approx(42.0) and c["per_seed"] == pytest.approx([42.0, 40.0, 44.0])
        assert (c["ci_low"], c["ci_high"]) == pytest.approx((42 - half, 42 + half))
        assert c["metric"] == "rel_l2 ratio" and c["seed_spread"] and c["paper_range_in_ci"]
    assert (by[1.0]["direction"], by[40.0]["direction"], by[44.0]["direction"]) == ("+", "+", "-")
    # against 1: surely farther; against 40 and 44: the interval straddles both, so neither is settled
    assert (by[1.0]["verdict"], by[40.0]["verdict"], by[44.0]["verdict"]) == ("reproduced", "unclear", "unclear")
    adjust(checks)  # the t evidence gives the same interval and the t pivot's p-value
    assert (by[1.0]["ci_low"], by[1.0]["ci_high"]) == pytest.approx((42 - half, 42 + half))
    assert by[1.0]["interval"] == "t"
    assert by[1.0]["p_value"] == pytest.approx(2 * sps.t.sf(41 / (2 / math.sqrt(3)), 2))
    assert by[44.0]["p_value"] == pytest.approx(2 * sps.t.sf(2 / (2 / math.sqrt(3)), 2))


def test_claim2_the_estimate_is_the_mean_of_per_seed_ratios_not_the_ratio_of_means():
    # seeds: 4 / 1 = 4 and 9 / 3 = 3: mean 3.5 (the ratio of means, 6.5 / 2 = 3.25, is not it)
    (c, *_) = distance_checks(_cfg(seeds=(0, 1)), _diffs([4.0, 9.0], [1.0, 3.0]), 1000)
    assert c["estimate"] == pytest.approx(3.5) and c["per_seed"] == pytest.approx([4.0, 3.0])
    half = sps.t.ppf(0.975, 1) * math.sqrt(0.5) / math.sqrt(2)  # SD of (4, 3) is sqrt(0.5)
    assert (c["ci_low"], c["ci_high"]) == pytest.approx((3.5 - half, 3.5 + half))


@pytest.mark.parametrize("ratios,verdicts,in_ci,claim", [
    # inside 40-44, tight (SD 0.1: 42 -+ 0.248): every check reproduced, and so the claim
    ((41.9, 42.0, 42.1), ("reproduced", "reproduced", "reproduced"), True, "reproduced"),
    # farther than the paper says (61 -+ 2.48): at least 40 yes, at most 44 no: the claim reads "mixed"
    ((60.0, 61.0, 62.0), ("reproduced", "reproduced", "contradicted"), False, "mixed"),
    # GRPO moved farther (0.5 -+ 0.248): every check contradicted
    ((0.4, 0.5, 0.6), ("contradicted", "contradicted", "reproduced"), False, "mixed"),
])
def test_claim2_against_one_and_the_papers_range(ratios, verdicts, in_ci, claim):
    checks = distance_checks(_cfg(), _diffs([r * 1e-3 for r in ratios], [1e-3] * 3), 1000)
    by = _claim2(checks)
    assert (by[1.0]["verdict"], by[40.0]["verdict"], by[44.0]["verdict"]) == verdicts
    assert by[1.0]["paper_range_in_ci"] is in_ci
    adjust(checks)
    (two,) = [c for c in claims_of(checks) if c["id"] == 2]
    assert two["verdict"] == claim


def test_claim2_one_seed_is_an_estimate_without_an_interval_and_grpo_at_zero_is_left_out():
    checks = distance_checks(_cfg(seeds=(0, 1)), _diffs([0.042, 0.5], [0.001, 0.0]), 1000)
    by = _claim2(checks)
    c = by[40.0]
    assert c["per_seed"] == pytest.approx([42.0]) and c["estimate"] == pytest.approx(42.0)  # seed 1: GRPO at 0
    assert math.isnan(c["ci_low"]) and math.isnan(c["ci_high"]) and not c["seed_spread"]
    assert {x["verdict"] for x in by.values()} == {"unclear"} and c["_evidence"] is None


def test_claim4_shares_per_seed():
    # ES's top 100: 80 in norm + attention; GRPO's: 10 (its norm). GRPO's: 60 in embed + lm_head, ES's 0
    checks = [c for c in distance_checks(_cfg(), _diffs([1.0] * 3, [1.0] * 3), 1000) if c["claim"] == 4]
    assert len(checks) == 4  # two groups x two rankings
    for c in checks:
        want = 0.8 - 0.1 if c["method"] == "es" else 0.6 - 0.0
        assert c["per_seed"] == pytest.approx([want] * 3) and c["estimate"] == pytest.approx(want)


# ------------------------------------------------------------------ claim 6: a population's share of the gain

N = 20  # samples per problem: Pass@1 = correct / 20
BASE = [2, 4, 6, 8, 10]  # Pass@1 .1 .2 .3 .4 .5
REF = [10, 12, 12, 18, 18]  # the reference es run: gains .4 .4 .3 .5 .4 (mean G = .4)


def _ev(counts, n=N):
    return {"per_problem": [{"n": n, "correct": c, "maj_at_k": {"2": float(c > n / 2)}} for c in counts]}


def test_claim6_share_of_the_reference_gain_with_its_fieller_interval():
    """A population whose per-problem gain is the reference's plus a constant c: A = G + c, and every
    (co)variance of the gains is the same v = Var(g) / P, so Fieller's limits solve A - ρG = -+ t s (1 - ρ):
    ρ = (A -+ t s) / (G -+ t s) (in either order), s = sqrt(v). Here Var(g) = .005 (SD of .4 .4 .3 .5 .4), P = 5, t = t_4."""
    cfg = _cfg(k=(1, 2), samples=N, population_sizes=(4, 8, 16))
    up = [c + 2 for c in REF]  # gains + .1: share (.4 + .1) / .4 = 1.25
    down = [c - 5 for c in REF]  # gains - .25: share .15 / .4 = .375
    evals = {"es": [_ev(REF)], "es-n4": [_ev(down)], "es-n16": [_ev(up)]}  # es-n8 not evaluated: no check
    checks = population_checks(cfg, [_ev(BASE)], evals, 1000)
    by = {c["population"]: c for c in checks}
    assert sorted(by) == [4, 16] and {c["claim"] for c in checks} == {6}
    ts = T4 * math.sqrt(0.005 / 5)
    for n, a, verdict in ((16, 0.5, "reproduced"), (4, 0.15, "contradicted")):
        c = by[n]
        assert c["method"] == f"es-n{n}" and c["null"] == SCALE_FRACTION and c["direction"] == "+"
        assert c["estimate"] == pytest.approx(a / 0.4)
        assert [c["ci_low"], c["ci_high"]] == pytest.approx(sorted([(a - ts) / (0.4 - ts), (a + ts) / (0.4 + ts)]))
        assert c["verdict"] == verdict and not c["seed_spread"]  # one seed a side: the problems' spread only
    adjust(checks)
    assert (by[16]["ci_low"], by[16]["ci_high"]) == pytest.approx(((0.5 + ts) / (0.4 + ts), (0.5 - ts) / (0.4 - ts)))
    assert by[16]["interval"] == "fieller" and by[16]["verdict"] == "reproduced"
    # the Fieller pivot at the null: (A - .9 G) / (s |1 - .9|) ~ t_4
    z = abs(0.15 - SCALE_FRACTION * 0.4) / (math.sqrt(0.005 / 5) * (1 - SCALE_FRACTION))
    assert by[4]["p_value"] == pytest.approx(2 * sps.t.sf(z, 4))


def test_claim6_and_7_checks_name_a_scaled_alpha():
    evals = {"es": [_ev(REF)], "es-n4": [_ev(REF)], "es-n16": [_ev(REF)], "es-2pt": [_ev(BASE)]}
    for rule, tag in (("fixed", ""), ("scaled", " (α scaled by N)")):
        cfg = _cfg(k=(1, 2), samples=N, population_sizes=(4,), two_point=True, population_alpha=rule)
        checks = population_checks(cfg, [_ev(BASE)], evals, 200)
        assert [c["claim"] for c in checks] == [6, 7, 7]
        assert checks[0]["check"].startswith(f"es N=4{tag}: share") and checks[1]["check"].startswith(
            f"two-point es (N=2) minus es-n16 (N=16){tag}, Pass@1")
        assert all(c["alpha_scaled"] is (rule == "scaled") for c in checks)


def test_claim6_no_reference_gain_is_untestable():
    cfg = _cfg(k=(1, 2), samples=N, population_sizes=(4,))
    (c,) = population_checks(cfg, [_ev(BASE)], {"es": [_ev(BASE)], "es-n4": [_ev(REF)]}, 1000)
    assert math.isnan(c["estimate"]) and math.isnan(c["ci_low"]) and c["verdict"] == "unclear"


# ------------------------------------------------------------------ claim 7: two-point ES against N=16


def test_two_point_reference_is_es_at_n16_whatever_the_presets_n():
    tiny = StudyConfig(model="tiny", methods=("es",), seeds=(0,), two_point=True)  # the tiny preset: N=32
    assert study_runs.preset_population(tiny) == 32 and study_runs.two_point_reference(tiny) == "es-n16"
    smol = StudyConfig(model="tiny", methods=("es",), seeds=(0,), two_point=True, preset="smollm2")  # N=16
    assert study_runs.preset_population(smol) == 16 and study_runs.two_point_reference(smol) == "es"


def _labels(cfg):
    return {r["label"]: r for r in study_runs.run_plan(cfg, Path("s"))}


def test_two_point_adds_an_n16_group_and_labels_keep_their_meaning():
    base = {"model": "tiny", "methods": ("es",), "seeds": (0,)}
    # without --two-point nothing is added: an existing study's plan is as it was
    assert list(_labels(StudyConfig(**base, population_sizes=(4,)))) == ["es-s0", "es-n4-s0"]
    added = _labels(StudyConfig(**base, two_point=True))
    assert list(added) == ["es-s0", "es-n16-s0", "es-2pt-s0"]
    asked = _labels(StudyConfig(**base, population_sizes=(16, 4), two_point=True))  # listed: reused, not doubled
    assert list(asked) == ["es-s0", "es-n4-s0", "es-n16-s0", "es-2pt-s0"]
    only = _labels(StudyConfig(**base, population_sizes=(16,)))
    # es-n16-s0 is one run whichever option asked for it (a rerun with --two-point resumes it)
    cfgs = [d["es-n16-s0"]["configs"]["es"].to_dict() for d in (added, asked, only)]
    assert cfgs[0] == cfgs[1] == cfgs[2] and cfgs[0]["population"] == 16
    assert added["es-n16-s0"]["group"] == "es-n16" and added["es-n16-s0"]["total"] == only["es-n16-s0"]["total"]
    for label in ("es-s0", "es-2pt-s0"):  # the runs a study had before keep their configs
        assert added[label]["configs"]["es"].to_dict() == asked[label]["configs"]["es"].to_dict()
    # a preset of N=16: the es runs are the reference, nothing is added
    smol = _labels(StudyConfig(**base, two_point=True, preset="smollm2"))
    assert list(smol) == ["es-s0", "es-2pt-s0"] and smol["es-s0"]["configs"]["es"].population == 16


def _claim7(cfg, evals):
    checks = population_checks(cfg, [_ev(BASE)], evals, 1000)
    return {c["metric"]: c for c in checks if c["claim"] == 7}


def test_claim7_compares_two_point_with_n16_not_the_presets_n():
    # Pass@1: two-point = es-n16 + .1 on every problem, the N=32 es run = two-point + .2 on every problem
    two, n16, es = [c + 2 for c in REF], REF, [c + 6 for c in REF]
    cfg = _cfg(k=(1, 2), samples=N, two_point=True)
    by = _claim7(cfg, {"es": [_ev(es)], "es-n16": [_ev(n16)], "es-2pt": [_ev(two)]})
    assert sorted(by) == ["pass@1", "pass@2"]
    c = by["pass@1"]
    assert c["reference"] == "es-n16" and c["reference_population"] == 16 and c["method"] == "es-2pt"
    assert "minus es-n16 (N=16)" in c["check"] and "N=16" in by["pass@2"]["check"]
    assert c["estimate"] == pytest.approx(0.1) and c["per_seed"] == pytest.approx([0.1])
    assert (c["ci_low"], c["ci_high"]) == pytest.approx((0.1, 0.1))  # the same difference on every problem
    assert c["null"] == TWO_POINT_MARGIN and c["direction"] == "-"
    # an advantage of .1 > the .02 margin: "no advantage" contradicted (against N=32 it would read reproduced)
    assert c["verdict"] == "contradicted"


def test_claim7_on_a_preset_of_n16_compares_with_es():
    two, es = [c + 2 for c in REF], REF
    cfg = _cfg(k=(1, 2), samples=N, two_point=True, preset="smollm2")
    c = _claim7(cfg, {"es": [_ev(es)], "es-2pt": [_ev(two)]})["pass@1"]
    assert c["reference"] == "es" and "minus es (N=16)" in c["check"] and c["estimate"] == pytest.approx(0.1)


def test_claim7_without_the_reference_evaluated_is_refused():
    from deltalens.errors import DeltalensError

    cfg = _cfg(k=(1, 2), samples=N, two_point=True)
    with pytest.raises(DeltalensError, match="compares the two-point runs with es-n16"):
        population_checks(cfg, [_ev(BASE)], {"es": [_ev(REF)], "es-2pt": [_ev(REF)]}, 1000)
