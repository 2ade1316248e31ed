"""Claim 3: most of the Pass@1 gain survives high sparsity, more than either control at equal sparsity.

For the first seed's ES and GRPO runs, Δ = θ - θ0 is thresholded at each --sparsity target with one global
τ (`deltalens.analysis.sparsify.thresholds_for_sparsity`), and compared at equal sparsity with a random
mask of Δ, and at equal norm with a uniform shrink of Δ (with --backend vllm all of them sampled on one
engine of the base, weights swapped in). Each model is evaluated for per-problem Pass@1
(`Measures.state_dict_pass1`, --sparsify-samples samples, cached).

`sparsity_task` (a graph task) measures and returns every per-problem Pass@1 list (small: problems x
points x 3); `sparsity_analysis` turns them into the report's section and the claim-3 checks: the share of
the gain kept (Fieller's interval, `multiplicity.fieller_share`; null 0.5) and threshold minus each
control (paired bootstrap). One run: the intervals are over test problems only (no seed spread).
"""

from __future__ import annotations

from deltalens.analysis import multiplicity, stats
from deltalens.io.runs import RunDir
from deltalens.study.checks import check
from deltalens.study.config import StudyConfig
from deltalens.study.executor import TaskContext
from deltalens.study.measures import measures_for, spec_of


def sparsity_task(ctx: TaskContext, cfg: StudyConfig, label: str) -> dict:
    """Per-problem Pass@1 of the base, the full run `label`, and at each target sparsity its thresholded Δ
    and both controls; with each point's τ and achieved sparsity."""
    from deltalens.analysis.sparsify import (
        apply_threshold,
        random_mask,
        thresholds_for_sparsity,
        uniform_shrink,
    )
    from deltalens.io.tensors import open_tensors

    m = measures_for(ctx, cfg)
    spec = spec_of(ctx, cfg, label)
    seed = int(label.rsplit("-s", 1)[1])
    weights = RunDir(spec).weights()
    with open_tensors(cfg.model) as bsrc, open_tensors(weights) as csrc:
        taus = thresholds_for_sparsity(bsrc, csrc, list(cfg.sparsity))
        base_sd = {n: bsrc.get(n) for n in bsrc.names()}
        ckpt_sd = {n: csrc.get(n) for n in csrc.names()}
    base_p1 = m.state_dict_pass1(cfg.model, base_sd, "base:" + m.hash(cfg.model), label="base")
    full_p1 = m.state_dict_pass1(cfg.model, ckpt_sd, "full:" + m.hash(spec), label=label)
    points = []
    for target, tau in zip(cfg.sparsity, taus):
        ctx.log(f"sparsity {target:g} of {label}: threshold, random mask, uniform shrink")
        tag = f"{m.hash(spec)}:{tau!r}"
        what = f"{label} at sparsity {target:g}"
        # one modified copy of the weights alive at a time (each is a whole model in fp32: with the base and
        # the run's weights beside it, three at once per target and the next target's made before the last
        # one's were freed took Qwen2.5-0.5B's study past 24 GB); each is seeded, so the order changes nothing
        thr, st = apply_threshold(base_sd, ckpt_sd, tau)
        point = {"target_sparsity": target, "tau": tau, "sparsity": st["sparsity"], "kept_l2_frac": st["kept_l2_frac"],
                 "threshold": m.state_dict_pass1(cfg.model, thr, "thr:" + tag, label=f"{what}, threshold")}
        del thr
        rnd, _ = random_mask(base_sd, ckpt_sd, st["sparsity"], seed=seed)
        point["random"] = m.state_dict_pass1(cfg.model, rnd, "rnd:" + tag, label=f"{what}, random mask")
        del rnd
        shr, _ = uniform_shrink(base_sd, ckpt_sd, st["kept_l2_frac"] or 0.0)
        point["shrink"] = m.state_dict_pass1(cfg.model, shr, "shr:" + tag, label=f"{what}, uniform shrink")
        del shr
        points.append(point)
    return {"base": base_p1, "full": full_p1, "points": points}


def sparsity_analysis(cfg: StudyConfig, res: dict, method: str, task_spec: str, R: int) -> dict:
    """The report's sparsify section of one run and its claim-3 checks (at targets >= 0.9)."""
    base_p1, full_p1 = res["base"], res["full"]
    points, checks = [], []
    for pt in res["points"]:
        p = {k: pt[k] for k in ("threshold", "random", "shrink")}
        target = pt["target_sparsity"]
        ret = {k: multiplicity.fieller_share([v], [full_p1], [base_p1]) for k, v in p.items()}
        ret = {k: (est, ev, ev.interval(stats.LEVEL)) for k, (est, ev) in ret.items()}
        points.append({"target_sparsity": target, "tau": pt["tau"], "sparsity": pt["sparsity"],
                       "kept_l2_frac": pt["kept_l2_frac"], "pass_at_k": {"1": sum(p["threshold"]) / len(base_p1)},
                       "gain_retained": ret["threshold"][0],
                       "controls": {k: {"pass_at_1": sum(v) / len(v), "gain_retained": ret[k][0],
                                        "ci": list(ret[k][2])} for k, v in p.items() if k != "threshold"},
                       "gain_retained_ci": list(ret["threshold"][2])})  # Fieller, as the claim-3 check
        if target >= 0.9:
            checks.append(check(3, f"{method}: Pass@1 gain kept at sparsity {target:g} (share)", method,
                                "gain retained", ret["threshold"][0], ret["threshold"][2], +1, null=0.5,
                                evidence=ret["threshold"][1], seed_spread=False))
            for ctl in ("random", "shrink"):
                e = stats.paired_effect([p["threshold"]], [p[ctl]], resamples=R, replicates=True)
                checks.append(check(3, f"{method}: threshold minus {ctl} at sparsity {target:g}, Pass@1", method,
                                    "pass@1", e["estimate"], e["ci"], +1, seed_spread=False,
                                    evidence=multiplicity.Replicates(e["replicates"])))
    section = {"task": task_spec, "backend": cfg.backend, "ks": [1],
               "base_pass_at_k": {"1": sum(base_p1) / len(base_p1)},
               "full_pass_at_k": {"1": sum(full_p1) / len(full_p1)}, "points": points}
    return {"section": section, "checks": checks}
