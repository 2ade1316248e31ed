"""`deltalens demo`: the whole study in one command, on the bundled tiny model and the default task.

    deltalens demo                      # ~10 min on 2 CPU cores: writes deltalens-demo/report.html
    deltalens demo --budget 4           # 4x the training compute (iterations / steps)

What it runs, in order (each step reuses what an earlier, identical run left on disk):
1. ES on `tiny`/`arith` (the tiny preset) for `es_iterations x budget` iterations -> runs/es
2. GRPO (TRL, tiny preset) for the FLOP-matched number of steps (deltalens.training.budget: N = 4G) -> runs/grpo
3. ES -> GRPO, the same total budget split half/half -> runs/es-grpo
4. `deltalens report tiny runs/es runs/grpo runs/es-grpo`: Pass@1/16/32 of all four on held-out test
   problems, weight diff, sparsification at target sparsities (global τ, re-evaluated), population
   diversity of the ES run, a held-out task, and the HTML report; a summary table on the terminal.

This is a demonstration at toy scale, not evidence: one seed, small budgets. `examples/` and
docs/reproduction.md hold the study with seeds and spread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deltalens.analysis.report import build_analysis
from deltalens.errors import DeltalensError
from deltalens.evaluation import parse_ks
from deltalens.io.atomic import write_json_atomic
from deltalens.io.runs import RunDir
from deltalens.reports import render_report
from deltalens.training.budget import es_units, steps_for_budget
from deltalens.training.chain import train_chain
from deltalens.training.es.config import ESConfig
from deltalens.training.es.train import train_es
from deltalens.training.grpo.config import GRPOConfig
from deltalens.training.grpo.train import train_grpo


@dataclass
class DemoConfig:
    out: str = "deltalens-demo"  # output directory (runs/, report.html, analysis json, cache)
    budget: float = 1.0  # scale of the training compute (1 = ~10 min in all on 2 CPU cores)
    model: str = "tiny"  # base model spec
    task: str = "arith"  # task (train split for training, test split for evaluation)
    es_iterations: int = 8  # ES iterations at budget 1 (the unit every method is matched to)
    limit: int = 100  # test problems evaluated per model
    samples: int = 32  # samples per problem (Pass@K up to K = samples)
    ks: str = "1,16,32"  # K values in the summary
    sparsity: str = "0.5,0.9,0.99"  # target sparsities for the sparsification curve
    held_out: str = "arith-3"  # held-out tasks for the forgetting table ("" = none)
    diversity_members: int = 8  # population size for the JS estimate
    diversity_prompts: int = 8  # prompts for the JS estimate
    seed: int = 0  # seed of every run

    def __post_init__(self):
        if self.budget <= 0:
            raise DeltalensError(f"--budget must be > 0 (got {self.budget}); 1 is the default demo size")
        if self.es_iterations < 1 or self.limit < 1 or self.samples < 1:
            raise DeltalensError("es_iterations, limit and samples must be >= 1")


def run_demo(cfg: DemoConfig, progress_factory=None, log: Callable[[str], None] = print) -> dict:
    """Run the demo (see module docstring); returns the analysis dict and writes the report."""
    out = Path(cfg.out)
    runs = out / "runs"
    t_start = time.time()
    timings: dict[str, float] = {}

    es_cfg = ESConfig.preset("tiny", model=cfg.model, task=cfg.task, seed=cfg.seed,
                             iterations=max(1, round(cfg.es_iterations * cfg.budget)))
    units = es_units(es_cfg.iterations, es_cfg.prompts_per_iteration, es_cfg.population)
    grpo_base = GRPOConfig.preset("tiny", model=cfg.model, task=cfg.task, seed=cfg.seed)
    grpo_steps = steps_for_budget(units, grpo_base.prompts_per_step, grpo_base.num_generations)
    grpo_cfg = GRPOConfig.preset("tiny", model=cfg.model, task=cfg.task, seed=cfg.seed, steps=grpo_steps)
    log(f"budget {units:,} units: ES {es_cfg.iterations} iterations (N={es_cfg.population}, "
        f"{es_cfg.prompts_per_iteration} prompts) = GRPO {grpo_steps} steps "
        f"(G={grpo_cfg.num_generations}, {grpo_cfg.prompts_per_step} prompts)")

    def bar(name, total):
        if progress_factory is None:
            return None
        update = progress_factory(name, total)
        return lambda done, _total, row=None: update(done, total)

    def stage(name, run_dir, total, fn):
        t0 = time.time()
        if RunDir(run_dir).finished(total):
            log(f"{name}: reusing {run_dir}")
        else:
            fn()
        timings[name] = round(time.time() - t0, 1)

    stage("es", runs / "es", es_cfg.iterations,
          lambda: train_es(es_cfg, runs / "es", progress=bar("train ES", es_cfg.iterations), overwrite=True))
    stage("grpo", runs / "grpo", grpo_steps,
          lambda: train_grpo(grpo_cfg, runs / "grpo", progress=bar("train GRPO", grpo_steps), overwrite=True))
    seq_total = max(1, es_cfg.iterations // 2) + max(1, grpo_steps // 2)
    stage("es-grpo", runs / "es-grpo", seq_total,
          lambda: train_chain(runs / "es-grpo", ("es", "grpo"), model=cfg.model, task=cfg.task, budget=units,
                                 es_config=es_cfg, grpo_config=grpo_cfg, overwrite=True,
                                 progress=bar("train ES->GRPO", seq_total)))

    t0 = time.time()
    models = [str(runs / m) for m in ("es", "grpo", "es-grpo")]
    targets = [float(x) for x in cfg.sparsity.split(",") if x.strip()]
    doc = build_analysis(
        cfg.model, models, labels=["es", "grpo", "es-grpo"], task=cfg.task, samples=cfg.samples,
        ks=sorted({k for k in parse_ks(cfg.ks) if k <= cfg.samples} | {1, cfg.samples}), limit=cfg.limit, seed=cfg.seed, sparsity_targets=targets,
        held_out=[h for h in cfg.held_out.split(",") if h], diversity=True,
        diversity_opts={"members": cfg.diversity_members, "prompts": cfg.diversity_prompts},
        diversity_models=["es"], sparsify_models=["es", "grpo"],
        cache_dir=out / "cache", log=log, progress_factory=progress_factory)
    timings["analysis"] = round(time.time() - t0, 1)
    timings["total"] = round(time.time() - t_start, 1)
    doc["demo"] = {"config": cfg.__dict__, "timings_s": timings, "budget_units": units}
    write_json_atomic(doc, out / "analysis.json")
    render_report(doc, out / "report.html")
    return doc
