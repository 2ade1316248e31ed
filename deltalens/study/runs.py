"""A study's runs: every method x seed at one FLOP-matched budget (--budget, else 20 iterations of the
model's ES preset; `deltalens.training.budget`), each in DIR/runs/<label>:

    es-s0, grpo-s0, es-grpo-s0, ...      the methods the claims compare (group = the method)
    es-n4-s0, es-n8-s0, ...              --population-sizes: ES at population N, same budget (more iterations
                                         at smaller N), for claim 6 (group es-n4, ...)
    es-2pt-s0, ...                       --two-point: ES with one antithetic pair (N = 2), same budget, for
                                         claim 7 (group es-2pt)

The extra runs keep the study's α, or with --population-alpha scaled take α·N/N_ref (`_es_variant`).

Claim 7 compares two-point ES with ES at N = 16 (TWO_POINT_REFERENCE_N, the paper's) at the same budget:
with --two-point the plan holds such a group (`two_point_reference`): the study's es runs when the preset's
N is 16, else es-n16, --population-sizes' run at N = 16, added when that option does not list 16. A label
always means one run (es-n16-s0 is ES at N = 16 on this budget, whichever option asked for it), so a
rerun with --two-point added resumes every run it already has.

`run_plan` resolves each run's configs (nothing is trained here); `deltalens.study.train` trains one.
"""

from __future__ import annotations

import os
from pathlib import Path

from deltalens.methods import chain_stages
from deltalens.presets import auto_preset
from deltalens.study.config import StudyConfig
from deltalens.training import methods
from deltalens.training.chain import stage_configs
from deltalens.training.es.config import ESConfig

TWO_POINT = "es-2pt"  # the group of --two-point's runs
TWO_POINT_REFERENCE_N = 16  # claim 7: two-point ES against ES at this population N (the paper's), same budget


def shown(run_dir, out: Path) -> str:
    """A run directory as the study's documents show it: relative to the study directory, so that a
    report names the same runs wherever the study was run or moved (runs/es-s0)."""
    return Path(os.path.relpath(run_dir, out)).as_posix()


def preset_of(cfg: StudyConfig) -> str:
    return auto_preset(cfg.model) if cfg.preset == "auto" else cfg.preset


def study_es(cfg: StudyConfig) -> ESConfig:
    """The study's ES settings: the ES preset with --es-options over it (what every es run trains with, but
    its seed and budget)."""
    return ESConfig.resolve(preset=preset_of(cfg), given=cfg.es_settings)


def study_budget(cfg: StudyConfig) -> float:
    """The units every method gets: --budget, else 20 iterations of the study's ES settings (`study_es`)."""
    if cfg.budget is not None:
        return float(cfg.budget)
    return float(methods.get("es").units(study_es(cfg), 20))


def preset_population(cfg: StudyConfig) -> int:
    """N of the study's es runs: the ES preset's population, or --es-options' population."""
    return study_es(cfg).population


def two_point_reference(cfg: StudyConfig) -> str:
    """The group claim 7 compares the two-point runs with (module docstring): es when the preset's N is
    TWO_POINT_REFERENCE_N, else es-n16."""
    return "es" if preset_population(cfg) == TWO_POINT_REFERENCE_N else f"es-n{TWO_POINT_REFERENCE_N}"


def population_sizes(cfg: StudyConfig) -> tuple[int, ...]:
    """The N of the extra ES groups es-n<N>: --population-sizes, plus N = 16 for claim 7's reference when
    --two-point needs one (`two_point_reference`), ascending."""
    sizes = set(cfg.population_sizes)
    if cfg.two_point and two_point_reference(cfg) != "es":
        sizes.add(TWO_POINT_REFERENCE_N)
    return tuple(sorted(sizes))


def _es_variant(preset: str, given: dict, population: int, two_point: bool, alpha_rule: str = "fixed") -> ESConfig:
    """ES at population N (two-point: N = 2 mirrored), every other setting the study's (`given`: the preset's
    with --es-options over them) but α under `alpha_rule` "scaled": α·N/N_ref (N_ref, α: the study's es runs').
    Population-batched generation is capped at N (it cannot batch more members than there are).

    Why scaled. The update (α/N)·Σ z_i ε_i has expectation ~α·ρ·ĝ (ĝ the reward gradient's direction, ρ the
    correlation of z with ε·ĝ) and a noise part of norm ~α·sqrt(d/N); at one budget N x iterations is fixed,
    so at fixed α a run at N/2 moves twice as far along ĝ *and* twice as far by noise. With α ∝ N both
    totals are the same at every N (first order), and what remains is what N itself does: the z-scores of
    a few rewards, and the path's curvature."""
    ref = ESConfig.resolve(preset=preset, given=given)
    batch = min(ref.population_batch, population)
    extra = {"population": population, "population_batch": batch, **({"antithetic": True} if two_point else {})}
    if alpha_rule == "scaled":
        extra["alpha"] = ref.alpha * population / ref.population
    return ESConfig.resolve(preset=preset, given={**given, **extra})


def run_plan(cfg: StudyConfig, out: Path) -> list[dict]:
    """Every run: its group (what the claims compare), method, seed, label, directory, total iterations/steps
    and the configs it trains with (nothing is trained here). The groups: the methods, then es-n<N> for each
    `population_sizes` N, then es-2pt."""
    preset, budget = preset_of(cfg), study_budget(cfg)
    common = {"model": cfg.model, "task": cfg.task, "chat_template": cfg.chat_template, "report_to": cfg.report_to,
              "keep_checkpoints": cfg.keep_checkpoints}
    groups = [(m, m, None) for m in cfg.methods]
    groups += [(f"es-n{n}", "es", n) for n in population_sizes(cfg)]
    groups += [(TWO_POINT, "es", 2)] if cfg.two_point else []
    plan = []
    for group, method, population in groups:
        for seed in cfg.seeds:
            label = f"{group}-s{seed}"
            d = out / "runs" / label
            given = {**common, "seed": seed, "budget": budget}
            stages = chain_stages(method)
            if population is not None:
                es = _es_variant(preset, {**cfg.es_settings, **given}, population, group == TWO_POINT,
                                 cfg.population_alpha)
                total, configs = es.iterations, {"es": es}
            elif stages is None:  # one method (deltalens.training.methods): its budget gives its count
                m = methods.get(method)
                c = m.config.resolve(preset=preset, given={**cfg.method_settings(method), **given})
                total, configs = m.total(c), {method: c}
            else:  # a chain: its stages split the budget (deltalens.training.chain.stage_configs)
                configs = {s: methods.get(s).config.resolve(
                    preset=preset, given={**cfg.method_settings(s), **common, "seed": seed})
                    for s in dict.fromkeys(stages)}
                cfgs = stage_configs(d, stages, cfg.model, cfg.task, configs, {}, budget)
                total = sum(methods.get(s).total(c) for s, c in zip(stages, cfgs))
            plan.append({"group": group, "method": method, "seed": seed, "label": label, "dir": d, "total": total,
                         "configs": configs})
    return plan


def by_group(plan: list[dict]) -> dict[str, list[dict]]:
    """The plan's runs by group (es, grpo, es-grpo, es-n4, es-2pt, ...), seeds in order."""
    out: dict[str, list[dict]] = {}
    for r in plan:
        out.setdefault(r["group"], []).append(r)
    return out
