"""`deltalens probe`: whether ES and GRPO have any reward signal on this model and task, before training.

The sampled pass runs at every --temperatures value (default 0.6,1.0: the paper's evaluation temperature and
GRPO's training temperature), so the base's Pass@K curve is recorded at both; --temperature T is one
temperature, as before (`deltalens.analysis.probe`)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from deltalens.analysis.options import ProbeConfig

from . import common as c
from . import options as o

MODEL = inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[
    str, typer.Argument(help="model: tiny, smollm2, HF dir, run dir, .gguf, hub id")])


def _probe(kwargs: dict) -> None:
    run_probe(kwargs["model"], o.resolve(ProbeConfig, kwargs))


def run_probe(model: str, cfg: ProbeConfig) -> None:
    """Can RL move MODEL on the task (the command's work): the table, the verdict, then JSON."""
    from deltalens.analysis.document import analysis_document, model_entry
    from deltalens.analysis.probe import check_probe_options, probe, probe_temperatures, signal_temperature
    from deltalens.io.atomic import write_json_atomic
    from deltalens.io.outputs import Output, check_outputs
    from deltalens.presets import auto_preset, default_task
    from deltalens.tasks import get_task

    task, split, limit, samples, group = cfg.task, cfg.split, cfg.limit, cfg.samples, cfg.group
    es_members, es_prompts, es_populations, es_sigma = cfg.es_members, cfg.es_prompts, cfg.es_populations, cfg.es_sigma
    chat_template, max_new_tokens, data, dtype, backend, seed = (cfg.chat_template, cfg.max_new_tokens, cfg.data,
                                                                 cfg.dtype, cfg.backend, cfg.seed)
    json_out = None if cfg.json is None else Path(cfg.json)
    # bad settings and an output that would destroy an input are refused before any data is read or model loads
    # (--temperature with --temperatures: by ProbeConfig)
    check_probe_options(limit=limit, samples=samples, group=group, temperature=cfg.temperature,
                        temperatures=cfg.temperatures, max_new_tokens=max_new_tokens, chat_template=chat_template,
                        es_members=es_members, es_prompts=es_prompts, es_populations=es_populations,
                        es_sigma=es_sigma, seed=seed, backend=backend)
    temps = probe_temperatures(cfg.temperature, cfg.temperatures)
    signal_t = signal_temperature(temps)
    check_outputs([Output(json_out, "--json")], models=[model], files=[data])
    t = get_task(task or default_task(model), data=data, question_field=cfg.question_field,
                 answer_field=cfg.answer_field)
    from deltalens.evaluation.cost import plan_line  # the sampled pass, the probe's main cost, said before it

    plan = c.FirstWork(_plan_line(plan_line, temps, problems=len(t.split(split, limit)), samples=samples,
                                  max_new_tokens=max_new_tokens or t.max_new_tokens, model=model, backend=backend,
                                  dtype=dtype, compute_dtype=cfg.compute_dtype))
    with c.progress_bar() as bar:
        factory = plan.factory(c.bar_factory(bar))
        res = probe(model, t, split=split, limit=limit, samples=samples, group=group, temperature=signal_t,
                    temperatures=temps, max_new_tokens=max_new_tokens, chat_template=chat_template,
                    es_preset=cfg.preset or auto_preset(model), es_members=es_members, es_prompts=es_prompts,
                    es_populations=es_populations, es_sigma=es_sigma, seed=seed, dtype=dtype, backend=backend,
                    log=lambda s: c.console.print(f"[dim]{c.escape(s)}[/]"), progress_factory=factory,
                    compute_dtype=cfg.compute_dtype)
    shown_t = ", ".join(f"{x:g}" for x in temps)
    table = Table(title=f"{model} on {t.spec} ({split}, {res['n_problems']} problems x {samples} samples, "
                        f"T={shown_t}{', chat template' if res['chat_template'] else ''})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    at = f", T={signal_t:g}" if len(temps) > 1 else ""  # rows of the signal temperature, named when there are more
    for s in res.get("sampled") or [{"temperature": signal_t, "pass_at_k": res["pass_at_k"]}]:  # one per T
        name = f"sampled, T={s['temperature']:g}" if len(temps) > 1 else "sampled"
        for k, v in s["pass_at_k"].items():
            table.add_row(f"Pass@{k} ({name})", f"{v:.3f}")
    table.add_row("Pass@1 (greedy, as ES decodes)", f"{res['greedy_pass_at_1']:.3f}")
    table.add_row(f"mean reward (sampled{at})", f"{res['mean_reward']:.3f}")
    table.add_row(f"format rate (#### <answer>{at})", f"{res['format_rate']:.3f}")
    table.add_row(f"GRPO groups of {group} with unequal rewards{at}", f"{res['grpo']['share_with_signal']:.3f}")
    if res["es"]:
        es = res["es"]
        table.add_row(f"ES populations (N={es['members']}, σ={es['sigma']:g}) with unequal rewards",
                      f"{es['share_with_signal']:.2f} (std {es['mean_reward_std']:.3f})")
    c.out.print(table)
    c.out.print(f"verdict: {res['verdict']}", highlight=False)
    if json_out is not None:
        doc = analysis_document(model, [model_entry("model", model)], probe={"model": res})
        write_json_atomic(doc, json_out)
        c.console.print(f"wrote {json_out}", markup=False)


def _plan_line(plan_line, temps, *, problems: int, samples: int, max_new_tokens: int, model: str, backend: str,
               dtype: str, compute_dtype: str) -> str:
    """The sampled pass's cost, said before it starts: every temperature's generations (one "point" of
    `plan_line` each, named a temperature here)."""
    what = "probe" if len(temps) == 1 else f"probe (sampled at T={', '.join(f'{t:g}' for t in temps)})"
    line = plan_line(what=what, models=1, points=len(temps), problems=problems, samples=samples,
                     max_new_tokens=max_new_tokens, model=model, backend=backend, dtype=dtype, device="cpu",
                     compute_dtype=compute_dtype)
    return line.replace(f" x {len(temps)} points", f" x {len(temps)} temperatures", 1) if len(temps) > 1 else line


probe_cmd = o.command("probe", "Can RL move this model on this task? Pass@K, format rate, reward, and the share of GRPO "
                      "groups and ES populations whose rewards differ (the only thing either method learns from), "
                      "with a verdict.", [MODEL, *o.config_params(ProbeConfig), o.config_file_param("probe")], _probe)
