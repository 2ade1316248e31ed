"""Claims 9 and 10 (ours): the ES population around the first ES run's final weights.

`diversity_task` (a graph task) samples --diversity-members members θ + σε around the run's last checkpoint
on --diversity-prompts test prompts (`deltalens.analysis.diversity.diversity_section`, cached) and returns
that section with its paths relative to the study directory. `diversity_checks`: claim 9, the population's
Jensen-Shannon divergence, the posterior (mutual-information) estimator `js_mi_mean` ± 1.96 SE (the one JS
estimator the verdicts use, named where shown), above 0; claim 10, Pass@N coverage of the population (one
sample per member) minus the centre's (N samples), bootstrap over prompts. One run: no seed spread.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from deltalens.analysis import multiplicity, stats
from deltalens.analysis.diversity.sampling import SAMPLER_VERSION
from deltalens.io.runs import RunDir
from deltalens.study.checks import check
from deltalens.study.config import StudyConfig
from deltalens.study.executor import TaskContext
from deltalens.study.measures import measures_for, spec_of

JS_ESTIMATOR = "js_mi_mean"  # the posterior (mutual-information) estimator: the one the verdict and report use


def diversity_task(ctx: TaskContext, cfg: StudyConfig, label: str) -> dict:
    """The diversity section of run `label` around its last checkpoint (paths relative to the study DIR)."""
    from deltalens.analysis.diversity import diversity_section

    m = measures_for(ctx, cfg)
    spec = spec_of(ctx, cfg, label)
    it = max(RunDir(spec).checkpoints())
    temperature = cfg.verdict_temperature
    key = m.cache.key("study-diversity", run=m.hash(spec), iteration=it, members=cfg.diversity_members,
                      prompts=cfg.diversity_prompts, temperature=temperature, chat=cfg.chat_template,
                      sampler=SAMPLER_VERSION)
    ctx.log(f"population diversity of {label} around iteration {it}")
    bar = []  # opened at the first report, once the population is loaded and the total known

    def progress(done, total, stage):
        if ctx.progress is None:
            return
        if not bar:
            bar.append(ctx.progress(f"diversity {label} (members sampled and scored, then the centre)", total))
        bar[0](done)

    div = m.cache.get_or_compute(key, lambda: diversity_section(
        m.ref(spec), m.task, members=cfg.diversity_members, iteration=it, prompts=cfg.diversity_prompts,
        samples=4, temperature=temperature, chat_template=cfg.chat_template, progress=progress), m.log)
    # the run and its checkpoint as the rest of the document names them: relative to DIR, not this machine's paths
    return {**div, **{k: Path(os.path.relpath(div[k], ctx.root)).as_posix()
                      for k in ("model", "centre") if isinstance(div.get(k), str)}}


def diversity_checks(div: dict, R: int) -> list[dict]:
    """Claim 9: population JS (posterior estimator) > 0; claim 10: coverage, population minus centre."""
    js, se = div[JS_ESTIMATOR], div["js_mi_se"] or 0.0
    checks = [check(9, "population JS (posterior estimator, js_mi_mean) > 0", "es", "js", js,
                    (js - 1.96 * se, js + 1.96 * se), +1, evidence=multiplicity.TStat(js, se, math.inf),
                    seed_spread=False)]
    gaps = [p["coverage_population"] - p["coverage_centre"] for p in div["per_prompt"]
            if p["coverage_centre"] is not None]
    if len(gaps) >= 2:
        ci = stats.mean_bootstrap(gaps, resamples=R)
        checks.append(check(10, "Pass@N: population (one sample each) minus centre (N samples)", "es",
                            "coverage gap", sum(gaps) / len(gaps), ci, +1, seed_spread=False,
                            evidence=multiplicity.Replicates(stats.mean_replicates(gaps, resamples=R))))
    return checks
