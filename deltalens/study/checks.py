"""A study's checks: one directional test each, with its interval, evidence and verdict.

A check states the paper's direction (+1 raises, -1 lowers) against a null (0 for a difference, 1 or 40/44
for a distance ratio, 0.5 or a stated fraction for a share of a gain, minus the non-inferiority margin for
a "keeps" check), an estimate and its 95% interval (`deltalens.analysis.stats`), and the evidence the
p-value and the Holm-level interval come from (`deltalens.analysis.multiplicity`: bootstrap `Replicates`,
a t statistic `TStat` over seeds, or a `Fieller` ratio). `adjust` applies Holm over every check of the
study at once; a claim's verdict is the agreement of its checks (`claim_verdict`).

The checks computed from the evaluations live here (claims 1, 5, 6 and 7: every method's effect on
Pass@K/Maj@K against one base, the mean over its sampling seeds per problem), with the distance checks
(claims 2 and 4), claim 7's paired-reward correlation of the two-point runs (from their metrics rows,
`two_point_checks`) and the entropy checks (claim 8); claim 3's come with the sparsity sweep
(`deltalens.study.sparsity`), claims 9 and 10's with the population (`deltalens.study.diversity`).
Claim 7 compares the two-point runs with ES at N = 16 on the same budget, the paper's comparison (the es
runs when the preset's N is 16, else the es-n16 runs --two-point adds: `deltalens.study.runs`); each check
names that group and N (`reference`, `reference_population`).

Claim 7's mechanism. Two-point ES estimates the gradient from one antithetic pair per iteration,
g ≈ (R+ - R-) ε / 2σ with R± = R(θ ± σε) (each the member's mean reward over the iteration's P prompts,
which both members share). Pairing helps when R+ and R- are positively correlated: the part of the reward
both share (this iteration's prompts, the current θ) cancels in R+ - R-, and
Var(R+ - R-) = Var(R+) + Var(R-) - 2 Cov(R+, R-). With one pair per iteration the covariance is estimated
across iterations: each run's pairs centred on that run's means and pooled over the runs (df = pairs - runs),
its interval a bootstrap of iterations within each run (stratified by run; not a seed spread). A reward that
trends over training adds to the covariance. Reported beside it: the covariance, the variance ratio
Var(R+ - R-) / (Var(R+) + Var(R-)) = 1 - 2 Cov / (Var(R+) + Var(R-)) (below 1: pairing removed shared
variance; 1 - corr for equal variances), the per-iteration paired differences' mean and SD, and the pairs
themselves. It is shown in claim 7's section and Holm-adjusted with the rest, but not part of the claim's
verdict (`in_verdict` False): the claim is "no advantage", the correlation is what the estimator relies on.
"""

from __future__ import annotations

import math

import numpy as np

from deltalens.analysis import multiplicity, stats
from deltalens.errors import DeltalensError
from deltalens.io.runs import RunDir
from deltalens.study.config import StudyConfig
from deltalens.study.measures import per_problem
from deltalens.study.runs import TWO_POINT, TWO_POINT_REFERENCE_N, two_point_reference

NORM_ATTN = ("norm", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_o", "attn_bias")
EMBED_HEAD = ("embed", "lm_head")
PAPER_RATIO = (40.0, 44.0)  # claim 2: the paper's range of rel. L2 ES / GRPO
SCALE_FRACTION = 0.9  # claim 6: a population "reaches" the reference ES gain when it keeps this share of it
TWO_POINT_MARGIN = 0.02  # claim 7: "no advantage" = two-point minus N=16 surely below this (Pass@K points)


def check(claim: int, name: str, method: str, metric: str, est: float, ci, direction: int,
          null: float = 0.0, *, evidence=None, seed_spread: bool = True, **extra) -> dict:
    """One check. `evidence` (`multiplicity.Replicates`, `TStat` or `Fieller`; None: untestable) is what
    `adjust` derives the p-value, the Holm-level interval and the Monte Carlo SEs from; `seed_spread`:
    whether its interval carries the spread over training seeds (claims 3, 9 and 10 measure seed 0 only)."""
    return {"claim": claim, "check": name, "method": method, "metric": metric, "estimate": est,
            "ci_low": ci[0], "ci_high": ci[1], "direction": "+" if direction > 0 else "-", "null": null,
            "verdict": stats.verdict(ci, direction, null), "seed_spread": bool(seed_spread),
            "_evidence": evidence, **extra}


def adjust(checks: list[dict]) -> list[dict]:
    """Holm across every check of the study (`multiplicity.judge`): each check keeps its unadjusted 95%
    interval (ci_low/ci_high, now from its evidence) with its bounds' Monte Carlo SEs and unadjusted verdict,
    and gets its p-value, Holm's adjusted p, the Holm-level interval, and `verdict`: Holm's. In place."""
    tests = [(c.pop("_evidence", None), float(c["null"]), 1 if c["direction"] == "+" else -1) for c in checks]
    for c, (ev, _, _), res in zip(checks, tests, multiplicity.judge(tests)):
        if ev is None:  # no evidence: the interval stays as it was (undefined), untestable
            res = {**res, "ci_low": c["ci_low"], "ci_high": c["ci_high"]}
        c.update(res)
    return checks


def claim_verdict(checks: list[dict]) -> str:
    v = {c["verdict"] for c in checks}
    if v == {"reproduced"}:
        return "reproduced"
    if v == {"contradicted"}:
        return "contradicted"
    if "reproduced" in v or "contradicted" in v:
        return "mixed"
    return "unclear"


def table_of(evs: list[dict], metric: str, k: int) -> list[list[float]]:
    """(runs or seeds, problems) per-problem values of one metric."""
    return [per_problem(e, metric, k) for e in evs]


def _effect_check(claim, name, meth, k, e, direction, null=0.0, *, trained_base=False, **extra) -> dict:
    """A check on one `stats.paired_effect` of Pass@k; its seed spread: the method's seeds, and the other
    side's too when that is a trained method (`trained_base`)."""
    spread = e["seeds"] > 1 or (trained_base and e["base_seeds"] > 1)
    return check(claim, name, meth, f"pass@{k}", e["estimate"], e["ci"], direction, null=null, per_seed=e["per_seed"],
                 evidence=multiplicity.Replicates(e["replicates"]), seed_spread=spread, **extra)


def method_effects(cfg: StudyConfig, base_evals: list[dict], evals_by_group: dict[str, list[dict]], R: int) -> dict:
    """Every group's effect on Pass@K and Maj@K (K > 1; Maj@1 = Pass@1) against the base: the mean over its
    sampling seeds, per problem (`stats.paired_effect`). Keyed (group, metric, k)."""
    effects = {}
    for group, evs in evals_by_group.items():
        for metric, ks in (("pass", cfg.k), ("maj", [k for k in cfg.k if k > 1])):
            for k in ks:
                effects[(group, metric, k)] = stats.paired_effect(table_of(evs, metric, k),
                                                                  table_of(base_evals, metric, k), span=1.0,
                                                                  resamples=R, replicates=True)
    return effects


def evaluation_checks(cfg: StudyConfig, base_evals: list[dict], evals_by_group: dict[str, list[dict]], R: int,
                      *, at: str = "", primary: bool = True) -> tuple[list[dict], dict]:
    """Claims 1 and 5 (and 6, 7 when their runs exist) from the evaluations at one temperature. Claim 1:
    GRPO's Pass@K checks, ES's Pass@1 (raises) and Pass@K>1 (keeps: non-inferiority at
    `cfg.noninferiority_margin`), problems lost (`stats.problems_lost`: GRPO's count per seed, and GRPO minus
    ES over the problems the base solves). Claim 5: ES->GRPO against ES and GRPO. `at`: a suffix naming the
    temperature when several are evaluated; `primary`: the verdict temperature (claims 5-7 there only)."""
    effects = method_effects(cfg, base_evals, evals_by_group, R)
    checks: list[dict] = []
    margin = cfg.noninferiority_margin
    k_hi = [k for k in cfg.k if k > 1]
    for meth, want in (("grpo", {1: +1, **{k: -1 for k in k_hi}}), ("es", {k: +1 for k in cfg.k})):
        if meth in evals_by_group:
            for k, d in want.items():
                e = effects[(meth, "pass", k)]
                keeps = meth == "es" and k > 1  # the paper's "keeps": not worse than the base by more than margin
                name = (f"{meth} vs base, Pass@{k}: keeps (non-inferior, margin {margin:g})" if keeps
                        else f"{meth} vs base, Pass@{k}")
                checks.append(_effect_check(1, name + at, meth, k, e, d, null=-margin if keeps else 0.0,
                                            base_value=e["base"]))
    checks += problems_lost_checks(cfg, base_evals, evals_by_group, R, at)
    if primary and "es-grpo" in evals_by_group:
        kmax = max(cfg.k)
        chain = evals_by_group["es-grpo"]
        for other in ("es", "grpo"):
            if other in evals_by_group:
                e = stats.paired_effect(table_of(chain, "pass", kmax), table_of(evals_by_group[other], "pass", kmax),
                                        trained_base=True, span=1.0, resamples=R, replicates=True)
                checks.append(_effect_check(5, f"es-grpo vs {other}, Pass@{kmax}", "es-grpo", kmax, e, +1,
                                            trained_base=True))
        if "grpo" in evals_by_group:
            a, g = table_of(chain, "pass", 1), table_of(evals_by_group["grpo"], "pass", 1)
            est, ev = multiplicity.fieller_share(a, g, table_of(base_evals, "pass", 1))
            checks.append(check(5, "es-grpo keeps GRPO's Pass@1 gain (share, Fieller)", "es-grpo",
                                "pass@1 gain share", est, ev.interval(stats.LEVEL), +1, null=0.5, evidence=ev,
                                seed_spread=len(a) > 1 or len(g) > 1))
    if primary:
        checks += population_checks(cfg, base_evals, evals_by_group, R)
    return checks, effects


def problems_lost_checks(cfg, base_evals, evals_by_group, R, at="") -> list[dict]:
    """The narrowing itself, which a net Pass@K can hide: problems the base solves at >= 4/32 that a run
    drops to <= 1 of its samples; GRPO's count per run, and GRPO minus ES (paired, over those problems)."""
    checks = []
    base_rates = [[r["correct"] / r["n"] for r in ev["per_problem"]] for ev in base_evals]
    lost = {meth: stats.problems_lost(base_rates, [[r["correct"] for r in ev["per_problem"]]
                                                   for ev in evals_by_group[meth]])
            for meth in ("grpo", "es") if meth in evals_by_group}
    what = f"base solves >= {stats.LOST_BASE_AT_LEAST * 32:g}/32, the run <= {stats.LOST_METHOD_AT_MOST}/{cfg.samples}"
    if "grpo" in lost:
        g = lost["grpo"]
        counts = g["per_seed"]
        checks.append(check(1, f"grpo: problems lost per run ({what}){at}", "grpo", "problems lost",
                            sum(counts) / len(counts), stats.seed_interval(counts), +1, per_seed=counts,
                            eligible=int(g["eligible"].size), evidence=multiplicity.TStat.from_seeds(counts),
                            seed_spread=len(counts) > 1))
        if "es" in lost:
            n_elig = int(g["eligible"].size)
            name = f"problems lost, grpo minus es (share of the {n_elig} the base solves){at}"
            if n_elig >= 2:
                e = stats.paired_effect(g["lost"], lost["es"]["lost"], trained_base=True, span=1.0, resamples=R,
                                        replicates=True)
                checks.append(check(1, name, "grpo", "problems lost share", e["estimate"], e["ci"], +1,
                                    per_seed=e["per_seed"], eligible=n_elig, lost_es=lost["es"]["per_seed"],
                                    evidence=multiplicity.Replicates(e["replicates"]),
                                    seed_spread=e["seeds"] > 1 or e["base_seeds"] > 1))
            else:  # fewer than 2 problems to compare on: untestable, shown as such
                checks.append(check(1, name, "grpo", "problems lost share", math.nan, (math.nan, math.nan), +1,
                                    eligible=n_elig, lost_es=lost["es"]["per_seed"]))
    return checks


def population_checks(cfg, base_evals, evals_by_group, R) -> list[dict]:
    """Claim 6: each --population-sizes N's share of the reference ES run's Pass@1 gain (Fieller; reached at
    SCALE_FRACTION). Claim 7: two-point ES (one antithetic pair) minus ES at N=16 at equal FLOPs (the group
    `runs.two_point_reference` names: es when the preset's N is 16, else es-n16), Pass@1 and Pass@Kmax: "no
    advantage" = surely below +TWO_POINT_MARGIN (direction -1 against that null)."""
    checks = []
    if "es" not in evals_by_group:
        return checks
    ref = evals_by_group["es"]
    base1 = table_of(base_evals, "pass", 1)
    scaled = cfg.population_alpha == "scaled"
    at = " (α scaled by N)" if scaled else ""  # --population-alpha: named in every check it changes
    for n in cfg.population_sizes:
        evs = evals_by_group.get(f"es-n{n}")
        if evs:
            est, ev = multiplicity.fieller_share(table_of(evs, "pass", 1), table_of(ref, "pass", 1), base1)
            checks.append(check(6, f"es N={n}{at}: share of the reference ES run's Pass@1 gain (Fieller), at least "
                                   f"{SCALE_FRACTION:g}", f"es-n{n}", "pass@1 gain share", est,
                                ev.interval(stats.LEVEL), +1, null=SCALE_FRACTION, evidence=ev,
                                seed_spread=len(evs) > 1, population=n, alpha_scaled=scaled))
    two = evals_by_group.get(TWO_POINT)
    if two:
        group = two_point_reference(cfg)
        other = evals_by_group.get(group)
        if not other:
            raise DeltalensError(f"claim 7 compares the two-point runs with {group} (ES at N="
                                 f"{TWO_POINT_REFERENCE_N}), which has no evaluations; rerun the study")
        for k in sorted({1, max(cfg.k)}):
            e = stats.paired_effect(table_of(two, "pass", k), table_of(other, "pass", k), trained_base=True,
                                    span=1.0, resamples=R, replicates=True)
            checks.append(_effect_check(7, f"two-point es (N=2) minus {group} (N={TWO_POINT_REFERENCE_N}){at}, "
                                           f"Pass@{k}: no advantage (below +{TWO_POINT_MARGIN:g})", TWO_POINT, k,
                                        e, -1, null=TWO_POINT_MARGIN, trained_base=True, reference=group,
                                        reference_population=TWO_POINT_REFERENCE_N, alpha_scaled=scaled))
    return checks


def paired_rewards(rows: list[dict]) -> list[tuple[float, float]]:
    """(R+, R-) of each trained iteration of a two-point run, from its metrics rows' `rewards` (member 0 draws
    +ε, member 1 its mirror -ε: `deltalens.training.es.strategy.member_noise`); iterations in order, a
    re-logged iteration (a resumed run) counted once, its last row."""
    by_it = {}
    for r in rows:
        it, rw = r.get("iteration"), r.get("rewards")
        if isinstance(it, int) and it > 0 and isinstance(rw, list):
            if len(rw) != 2:
                raise DeltalensError(f"iteration {it} has {len(rw)} member rewards; a two-point run has 2")
            by_it[it] = (float(rw[0]), float(rw[1]))
    return [by_it[k] for k in sorted(by_it)]


def _pooled(xs: list[np.ndarray], ys: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Within-run pooled (co)variances of R+ and R- over the last axis: each run centred on its own means,
    df = pairs - runs. Arrays (..., n_i) per run; returns arrays of the leading shape."""
    sxy = sxx = syy = 0.0
    df = 0
    for x, y in zip(xs, ys):
        xc, yc = x - x.mean(-1, keepdims=True), y - y.mean(-1, keepdims=True)
        sxy, sxx, syy = sxy + (xc * yc).sum(-1), sxx + (xc * xc).sum(-1), syy + (yc * yc).sum(-1)
        df += x.shape[-1] - 1
    cov, vx, vy = sxy / df, sxx / df, syy / df
    with np.errstate(divide="ignore", invalid="ignore"):
        corr = np.where((vx > 0) & (vy > 0), cov / np.sqrt(vx * vy), np.nan)
        ratio = np.where(vx + vy > 0, 1 - 2 * cov / (vx + vy), np.nan)
    return {"cov": np.asarray(cov, float), "corr": np.asarray(corr, float), "ratio": np.asarray(ratio, float)}


def paired_reward_stats(pairs_by_run: dict[str, list[tuple[float, float]]], resamples: int, seed: int = 0) -> dict:
    """The paired-reward statistics of claim 7 (module docstring) and their bootstrap replicates: corr, cov
    and the variance ratio (pooled within runs), each run's own corr (`per_seed`), the paired differences
    R+ - R- (mean, SD over all iterations). Needs >= 2 pairs in each run and >= 3 in all."""
    runs = {k: np.asarray(v, dtype=float).reshape(-1, 2) for k, v in pairs_by_run.items()}
    if not runs or any(len(v) < 2 for v in runs.values()) or sum(len(v) for v in runs.values()) < 3:
        raise DeltalensError("the paired-reward correlation needs >= 2 iterations in each two-point run "
                             "and >= 3 in all")
    xs, ys = [v[:, 0] for v in runs.values()], [v[:, 1] for v in runs.values()]
    point = _pooled(xs, ys)
    rng = np.random.default_rng(seed)
    idx = [rng.integers(0, len(x), (resamples, len(x))) for x in xs]  # iterations resampled within each run
    reps = _pooled([x[i] for x, i in zip(xs, idx)], [y[i] for y, i in zip(ys, idx)])
    d = np.concatenate([x - y for x, y in zip(xs, ys)])
    per_seed = [float(_pooled([x], [y])["corr"]) for x, y in zip(xs, ys)]
    return {"corr": float(point["corr"]), "cov": float(point["cov"]), "ratio": float(point["ratio"]),
            "replicates": reps, "per_seed": per_seed, "iterations": int(d.size), "runs": len(runs),
            "difference_mean": float(d.mean()), "difference_sd": float(d.std(ddof=1)) if d.size > 1 else math.nan}


def _percentiles(values: np.ndarray) -> list[float]:
    v = values[np.isfinite(values)]
    if v.size == 0:
        return [math.nan, math.nan]
    return [float(q) for q in np.quantile(v, [(1 - stats.LEVEL) / 2, (1 + stats.LEVEL) / 2])]


def two_point_pairs(label: str, run_dir) -> list[tuple[float, float]]:
    """The (R+, R-) pairs of one two-point run, from its directory's config.json and metrics rows; refused
    when the run is not two-point (N = 2, antithetic)."""
    run = RunDir(run_dir)
    cfg = run.config()
    if cfg.get("population") != 2 or not cfg.get("antithetic"):
        raise DeltalensError(f"{label} is not a two-point run (population {cfg.get('population')}, "
                             f"antithetic {cfg.get('antithetic')}); its rewards are not pairs")
    return paired_rewards(run.metrics())


def two_point_checks(runs: dict, R: int) -> list[dict]:
    """Claim 7's paired-reward check over the two-point runs (`runs`: label -> run directory)."""
    return pair_checks({label: two_point_pairs(label, d) for label, d in runs.items()}, R)


def pair_checks(pairs: dict, R: int) -> list[dict]:
    """Claim 7's paired-reward check from the two-point runs' pairs (label -> [(R+, R-)]; module docstring):
    corr(R+, R-) > 0, shown beside the claim's checks, not part of its verdict. The pairs are kept in the
    check, so a published study re-derives it (`deltalens.study.verify`)."""
    pairs = {k: [tuple(p) for p in v] for k, v in pairs.items()}
    name = ("two-point es: paired rewards R(θ+σε), R(θ-σε) positively correlated over iterations (what pairing "
            "relies on; not part of the verdict)")
    common = {"in_verdict": False, "seed_spread": False, "pairs": {k: [list(p) for p in v] for k, v in pairs.items()}}
    try:
        st = paired_reward_stats(pairs, R)
    except DeltalensError:  # too few iterations: untestable, shown as such
        return [check(7, name, "es-2pt", "corr(R+, R-)", math.nan, (math.nan, math.nan), +1, **common)]
    reps = st["replicates"]
    corr = reps["corr"][np.isfinite(reps["corr"])]
    # a resample whose R+ or R- has no variance has no correlation: dropped; untestable when most are
    ev = multiplicity.Replicates(corr) if corr.size >= R / 2 and math.isfinite(st["corr"]) else None
    return [check(7, name, "es-2pt", "corr(R+, R-)", st["corr"], _percentiles(reps["corr"]), +1, evidence=ev,
                  per_seed=st["per_seed"], covariance=st["cov"], covariance_ci=_percentiles(reps["cov"]),
                  variance_ratio=st["ratio"], variance_ratio_ci=_percentiles(reps["ratio"]),
                  paired_difference_mean=st["difference_mean"], paired_difference_sd=st["difference_sd"],
                  iterations=st["iterations"], runs=st["runs"], **common)]


def distance_checks(cfg: StudyConfig, diffs: dict, R: int) -> list[dict]:
    """Claim 2: rel. L2 from init, ES / GRPO per seed, farther (null 1) and within the paper's 40-44x (at least
    40, at most 44: both reproduced = inside the range; an estimate above it reads "mixed"). Claim 4: the
    top-100 coordinates' share in norm + attention (ES) and embed + lm_head (GRPO), per seed, by |Δ| and
    |Δ|/|θ0|."""
    checks: list[dict] = []
    pairs = [(f"es-s{s}", f"grpo-s{s}") for s in cfg.seeds]
    ratios = [diffs[a]["whole"]["rel_l2"] / diffs[b]["whole"]["rel_l2"] for a, b in pairs if diffs[b]["whole"]["rel_l2"]]
    if ratios:
        ci = stats.seed_interval(ratios)
        est = sum(ratios) / len(ratios)
        ev = multiplicity.TStat.from_seeds(ratios)
        lo, hi = PAPER_RATIO
        common = {"per_seed": ratios, "evidence": ev, "seed_spread": len(ratios) > 1,
                  "paper_range_in_ci": bool(ci[0] <= hi and ci[1] >= lo)}
        checks.append(check(2, "rel. L2 from init, ES / GRPO (per seed): ES farther", "es/grpo", "rel_l2 ratio",
                            est, ci, +1, null=1.0, **common))
        checks.append(check(2, f"the same ratio: at least the paper's {lo:g}x", "es/grpo", "rel_l2 ratio", est, ci,
                            +1, null=lo, **common))
        checks.append(check(2, f"the same ratio: at most the paper's {hi:g}x", "es/grpo", "rel_l2 ratio", est, ci,
                            -1, null=hi, **common))
    for rank in ("abs", "rel"):
        def share(label, groups, rank=rank):
            comp = diffs[label]["topk"][rank]["composition"]
            total = sum(comp.values())
            return sum(comp.get(g, 0) for g in groups) / total if total else 0.0

        for groups, name, who in ((NORM_ATTN, "norm + attention", "es"), (EMBED_HEAD, "embed + lm_head", "grpo")):
            other = "grpo" if who == "es" else "es"
            vals = [share(f"{who}-s{s}", groups) - share(f"{other}-s{s}", groups) for s in cfg.seeds]
            ci = stats.seed_interval(vals)
            checks.append(check(4, f"top-100 by {'|Δ|' if rank == 'abs' else '|Δ|/|θ0|'}: share in {name}, "
                                   f"{who} minus {other}", who, f"top-100 {rank} share", sum(vals) / len(vals),
                                ci, +1, per_seed=vals, evidence=multiplicity.TStat.from_seeds(vals),
                                seed_spread=len(vals) > 1))
    return checks


def entropy_checks(base_ent: list[float], ent: dict[str, list[list[float]]], R: int) -> list[dict]:
    """Claim 8 (ours): GRPO lowers token entropy against the base; ES keeps more of it than GRPO."""
    checks = []
    if "grpo" in ent:
        e = stats.paired_effect(ent["grpo"], [base_ent], resamples=R, replicates=True)
        checks.append(check(8, "grpo vs base, token entropy", "grpo", "entropy", e["estimate"], e["ci"], -1,
                            per_seed=e["per_seed"], evidence=multiplicity.Replicates(e["replicates"]),
                            seed_spread=e["seeds"] > 1))
    if "es" in ent and "grpo" in ent:
        e = stats.paired_effect(ent["es"], ent["grpo"], trained_base=True, resamples=R, replicates=True)
        checks.append(check(8, "token entropy, es minus grpo", "es", "entropy", e["estimate"], e["ci"], +1,
                            per_seed=e["per_seed"], evidence=multiplicity.Replicates(e["replicates"]),
                            seed_spread=e["seeds"] > 1 or e["base_seeds"] > 1))
    return checks


def effects_summary(effects: dict) -> dict:
    """The study's `effects` (what the summary rows show): the same effects as the claim-1 checks."""
    return {f"{meth}:{metric}@{k}": {kk: effects[(meth, metric, k)][kk] for kk in ("estimate", "method", "base", "ci")}
            for (meth, metric, k) in effects}
