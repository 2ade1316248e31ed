"""`deltalens diversity`: Jensen-Shannon divergence across ES population members, and their coverage.

    deltalens diversity tiny --task arith --members 8 --sigma 3e-3 --prompts 8 --samples 4
    deltalens diversity runs/es --task arith --iteration 20 --json div.json      # the run's own members
    deltalens diversity tiny --task arith --members 8 --sweep 3e-4,1e-3,3e-3      # + the small-σ law
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from deltalens.analysis.options import DiversityConfig

from . import common as c
from . import options as o

MODEL = inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[
    str, typer.Argument(help="model (tiny, HF dir, checkpoint) or an ES run directory")])


def _diversity(kwargs: dict) -> None:
    # --compute-dtype: the population's sampling (deltalens.analysis.diversity) takes none yet
    cfg = o.resolve(DiversityConfig, kwargs, unsupported={"compute_dtype": "it samples and scores in fp32: its JS estimate needs exact log-probabilities"})
    run_diversity(kwargs["model"], cfg)


def run_diversity(model: str, cfg: DiversityConfig) -> None:
    """Population diversity of MODEL (the command's work): the summary table, the σ sweep's, then JSON."""
    from deltalens.analysis.diversity import diversity_analysis
    from deltalens.io.atomic import write_json_atomic
    from deltalens.io.outputs import Output, check_outputs
    from deltalens.io.spec import arch_for, resolve, resolve_arch
    from deltalens.presets import default_task
    from deltalens.tasks import get_task

    task, members, sigma, iteration, prompts, samples = (cfg.task, cfg.members, cfg.sigma, cfg.iteration,
                                                         cfg.prompts, cfg.samples)
    temperature, sweep, fisher_samples, max_new_tokens, seed = (cfg.temperature, cfg.sweep, cfg.fisher_samples,
                                                                cfg.max_new_tokens, cfg.seed)
    data, question_field, answer_field, arch = cfg.data, cfg.question_field, cfg.answer_field, cfg.arch
    json_out = None if cfg.json is None else Path(cfg.json)
    sigmas = c.parse_floats(sweep, "--sweep") if sweep else None
    _check_options(members=members, sigma=sigma, iteration=iteration, prompts=prompts, samples=samples,
                   temperature=temperature, sweep=sigmas, fisher_samples=fisher_samples,
                   max_new_tokens=max_new_tokens, config=arch)
    arch = resolve_arch(arch)
    ref = resolve(model, arch=arch)  # once: the guard, the architecture and the population take this reference
    config = None if iteration is not None else arch_for(ref)  # bare weights: --arch, else beside
    check_outputs([Output(json_out, "--json")], models=[ref, arch], files=[data])
    t = get_task(task or default_task(model), data=data, question_field=question_field, answer_field=answer_field)
    t.test(prompts)  # a jsonl task's data is read (and refused) now
    plan = c.FirstWork(_plan_line(model, t, members=members, iteration=iteration, prompts=prompts, samples=samples,
                                  sweep=sigmas, max_new_tokens=max_new_tokens))
    with c.progress_bar() as bar:
        tid = []

        def progress(done, total, stage):
            if not tid:  # the population is loaded: say the cost, then open the bar, before any generation
                plan.say()
                tid.append(bar.add_task(stage, total=total))
            bar.update(tid[0], completed=done, total=total, description=stage)

        doc = diversity_analysis(ref, t, label=cfg.label, members=members, sigma=sigma, iteration=iteration,
                                 prompts=prompts, samples=samples, temperature=temperature, seed=seed,
                                 sweep=sigmas, fisher_samples=fisher_samples, max_new_tokens=max_new_tokens,
                                 dtype=cfg.dtype, config=config, progress=progress, chat_template=cfg.chat_template)
    lbl, d = next(iter(doc["diversity"].items()))
    c.out.print(_summary(lbl, d))
    if d.get("sigma_sweep"):
        c.out.print(_sweep_table(d["sigma_sweep"]))
    for note in d.get("notes", []):
        c.console.print(f"[yellow]note:[/] {c.escape(note)}", highlight=False)
    if json_out is not None:
        write_json_atomic(doc, json_out)
        c.console.print(f"wrote {json_out}", markup=False)


diversity = o.command("diversity", "Population diversity: JS across members (± standard error), JS of success, "
                      "coverage vs centre.",
                      [MODEL, *o.config_params(DiversityConfig), o.config_file_param("diversity")], _diversity)


def _plan_line(model: str, task, *, members, iteration, prompts: int, samples: int, sweep, max_new_tokens) -> str:
    """The sampling pass's cost (`deltalens.evaluation.cost.plan_line`): every member and the centre, each on the
    first `prompts` test problems x `samples`; the σ sweep's passes come on top and are named, not counted."""
    import json
    from pathlib import Path

    from deltalens.evaluation.cost import plan_line

    n = members
    if n is None and iteration is not None:  # the run's own population
        n = json.loads((Path(model) / "config.json").read_text()).get("population")
    n = n or 32
    line = plan_line(what=f"diversity (N={n} members and the centre)", models=n + 1,
                     problems=len(task.test(prompts)), samples=samples,
                     max_new_tokens=max_new_tokens or task.max_new_tokens, model=model)
    return line + (f"; the σ sweep ({len(sweep)} values) and the Fisher trace add to it" if sweep else "")


def _check_options(*, members, sigma, iteration, prompts, samples, temperature, sweep, fisher_samples,
                   max_new_tokens, config) -> None:
    """Refuse bad option values before a model is loaded (one line naming the option)."""
    import math

    from deltalens.errors import DeltalensError

    def finite(x) -> bool:
        return x is not None and math.isfinite(x)

    if members is not None and members < 2:
        raise DeltalensError(f"--members must be >= 2 (got {members}): diversity is measured across members")
    if sigma is not None and not (finite(sigma) and sigma >= 0):
        raise DeltalensError(f"--sigma must be a finite number >= 0 (got {sigma})")
    if iteration is not None and iteration < 0:
        raise DeltalensError(f"--iteration must be >= 0 (got {iteration})")
    for name, value in (("--prompts", prompts), ("--samples", samples), ("--fisher-samples", fisher_samples),
                        ("--max-new-tokens", max_new_tokens)):
        if value is not None and value < 1:
            raise DeltalensError(f"{name} must be >= 1 (got {value})")
    if not (finite(temperature) and temperature > 0):
        raise DeltalensError(f"--temperature must be a finite number > 0 (got {temperature}): diversity is "
                             "measured on samples")
    if sweep is not None and not all(finite(s) and s > 0 for s in sweep):
        raise DeltalensError(f"--sweep values must be finite numbers > 0 (got {','.join(map(str, sweep))})")
    if config is not None and iteration is not None:
        raise DeltalensError("--arch is for bare weight files; with --iteration the run's checkpoints are used")


def _f(x, spec=".4g") -> str:
    return "—" if x is None else format(x, spec)


def _summary(label: str, d: dict) -> Table:
    where = f"iteration {d['centre_iteration']}" if d.get("centre_iteration") is not None else "fresh noise"
    table = Table(title=f"{label} on {d['task']}: N={d['members']}, σ={d['sigma']:g} ({where}), "
                        f"{d['prompts']} prompts × {d['samples']} samples, T={d['temperature']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    b = d["coverage_bound"]
    bound = f"{_f(b['lhs'], '.3f')} ≥ {_f(b['rhs'], '.3f')}: {'holds' if b['holds'] else 'VIOLATED'}"
    rows = [
        ("JS across members, posterior estimator (nats)", f"{_f(d['js_mean'])} ± {_f(d['js_se'], '.2g')}"),
        ("JS, direct estimator (cross-check)", f"{_f(d['js_direct_mean'])} ± {_f(d['js_direct_se'], '.2g')}"),
        ("JS maximum, log N", _f(d["js_max"])),
        ("JS of success (verifier)", _f(d["js_succ_mean"])),
        ("success rate: members / centre", f"{_f(d['p_members_mean'], '.3f')} / {_f(d['p_centre_mean'], '.3f')}"),
        ("Pass@N: population (1 sample each)", _f(d["coverage_population"], ".3f")),
        ("Pass@N: centre (N samples)", _f(d["coverage_centre"], ".3f")),
        ("bound 1-Π(1-p_i) ≥ 1-(1-p̄)^N", bound),
        ("centre token entropy, T / T=1", f"{_f(d['token_entropy'])} / {_f(d['token_entropy_t1'])}"),
        ("sequences sampled / scored", f"{d['cost']['sampled']} / {d['cost']['scored']}"),
        ("seconds", _f(d["timing"].get("total_s"), ".1f")),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _sweep_table(rows: list[dict]) -> Table:
    table = Table(title=f"small-σ law: JS ≈ (σ²/2)(1-1/N) tr I, tr I = {rows[0]['fisher_trace']:.4g} ± "
                        f"{rows[0]['fisher_trace_se']:.2g}")
    for col in ("σ", "JS (posterior)", "JS (direct)", "predicted", "on drawn ε", "ratio", "ratio (direct)",
                "paired, drawn ε"):
        table.add_column(col, justify="right")
    for r in rows:
        paired = "—" if r["ratio_paired_draw"] is None else \
            f"{r['ratio_paired_draw']:.3f} ± {r['ratio_paired_draw_se']:.2g}"
        table.add_row(f"{r['sigma']:g}", f"{r['js_mean']:.4g} ± {r['js_se']:.2g}",
                      f"{r['js_direct_mean']:.4g} ± {r['js_direct_se']:.2g}", f"{r['js_pred']:.4g}",
                      _f(r["js_pred_draw"]), _f(r["ratio"], ".3f"), _f(r["ratio_direct"], ".3f"), paired)
    return table
