"""`deltalens probe`: whether ES and GRPO have any reward signal on this model and task, before training."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from . import common as c


def probe_cmd(
    model: Annotated[str, typer.Argument(help="model: tiny, smollm2, HF dir, run dir, .gguf, hub id")],
    task: c.Task = None,
    split: c.Split = "validation",
    limit: Annotated[int, typer.Option("--limit", help="problems of the split")] = 200,
    samples: Annotated[int, typer.Option("--samples", "-n", help="samples per problem (K of Pass@K)")] = 32,
    group: Annotated[int, typer.Option("--group", "-G", help="GRPO group size G (groups are cut from the samples)")
                     ] = 8,
    temperature: Annotated[float, typer.Option("--temperature", help="sampling temperature (GRPO trains at 1.0)")
                           ] = 1.0,
    es_members: Annotated[int, typer.Option("--es-members", help="members per ES population")] = 8,
    es_prompts: Annotated[int, typer.Option("--es-prompts", help="training prompts per ES population")] = 16,
    es_populations: Annotated[int, typer.Option("--es-populations", help="ES populations scored (0 = skip ES)")] = 2,
    es_sigma: Annotated[float | None, typer.Option("--es-sigma", help="ES noise scale (default: the preset's)")
                        ] = None,
    preset: Annotated[str | None, typer.Option("--preset", help="ES preset for σ (default: the model's own)")] = None,
    chat_template: c.ChatTemplate = "auto",
    max_new_tokens: c.MaxNewTokens = None,
    data: c.Data = None,
    question_field: c.QuestionField = "question",
    answer_field: c.AnswerField = "answer",
    dtype: c.Dtype = "fp32",
    backend: Annotated[str, typer.Option("--backend", help="backend of the sampled and greedy passes: hf, or vllm "
                                         "(docs/vllm.md); ES populations always score on HF, as training does")
                       ] = "hf",
    seed: c.Seed = 0,
    json_out: c.JsonOut = None,
):
    """Can RL move this model on this task? Pass@K, format rate, reward, and the share of GRPO groups and ES
    populations whose rewards differ (the only thing either method learns from), with a verdict."""
    from deltalens.analysis.document import analysis_document, model_entry
    from deltalens.analysis.probe import check_probe_options, probe
    from deltalens.io.atomic import write_json_atomic
    from deltalens.io.outputs import Output, check_outputs
    from deltalens.presets import auto_preset, default_task
    from deltalens.tasks import get_task

    # bad settings and an output that would destroy an input are refused before any data is read or model loads
    check_probe_options(limit=limit, samples=samples, group=group, temperature=temperature,
                        max_new_tokens=max_new_tokens, chat_template=chat_template, es_members=es_members,
                        es_prompts=es_prompts, es_populations=es_populations, es_sigma=es_sigma, seed=seed,
                        backend=backend)
    check_outputs([Output(json_out, "--json")], models=[model], files=[data])
    t = get_task(task or default_task(model), data=data, question_field=question_field, answer_field=answer_field)
    from deltalens.evaluation.cost import plan_line  # the sampled pass, the probe's main cost, said before it

    plan = c.FirstWork(plan_line(what="probe", models=1, problems=len(t.split(split, limit)), samples=samples,
                                 max_new_tokens=max_new_tokens or t.max_new_tokens, model=model, backend=backend,
                                 dtype=dtype, device="cpu"))
    with c.progress_bar() as bar:
        factory = plan.factory(c.bar_factory(bar))
        res = probe(model, t, split=split, limit=limit, samples=samples, group=group, temperature=temperature,
                    max_new_tokens=max_new_tokens, chat_template=chat_template, es_preset=preset or auto_preset(model),
                    es_members=es_members, es_prompts=es_prompts, es_populations=es_populations, es_sigma=es_sigma,
                    seed=seed, dtype=dtype, backend=backend, log=lambda s: c.console.print(f"[dim]{c.escape(s)}[/]"),
                    progress_factory=factory)
    table = Table(title=f"{model} on {t.name} ({split}, {res['n_problems']} problems x {samples} samples, "
                        f"T={temperature}{', chat template' if res['chat_template'] else ''})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for k, v in res["pass_at_k"].items():
        table.add_row(f"Pass@{k} (sampled)", f"{v:.3f}")
    table.add_row("Pass@1 (greedy, as ES decodes)", f"{res['greedy_pass_at_1']:.3f}")
    table.add_row("mean reward (sampled)", f"{res['mean_reward']:.3f}")
    table.add_row("format rate (#### <answer>)", f"{res['format_rate']:.3f}")
    table.add_row(f"GRPO groups of {group} with unequal rewards", f"{res['grpo']['share_with_signal']:.3f}")
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
