"""`deltalens eval`: Pass@K / Maj@K of one or more models on a task."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from . import common as c


def eval_cmd(
    models: Annotated[list[str], typer.Argument(help="models: tiny, smollm2, HF dir, run dir, hub id, .gguf, .pt, .safetensors")],
    task: c.Task = None,
    samples: c.Samples = 32,
    k: c.Ks = "1,16,32",
    temperature: c.Temperature = 0.6,
    limit: c.Limit = None,
    json_out: c.JsonOut = None,
    label: Annotated[list[str] | None, typer.Option("--label", help="label per model (repeat)")] = None,
    data: c.Data = None,
    question_field: c.QuestionField = "question",
    answer_field: c.AnswerField = "answer",
    config: c.Config = None,
    dtype: c.Dtype = "fp32",
    max_new_tokens: c.MaxNewTokens = None,
    seed: c.Seed = 0,
    backend: c.Backend = "hf",
    chat_template: c.ChatTemplate = "auto",
    split: Annotated[str | None, typer.Option("--split", help="problems to use: test (reports) or validation "
                                              "(tuning) [default: test]")] = None,
    trained_on: Annotated[str | None, typer.Option("--trained-on", help="score the problems this run directory "
                                                   "trained on (every iteration's prompts, up to its weights) "
                                                   "instead of a split, with the run's task")] = None,
    device: c.Device = "auto",
):
    """Evaluate Pass@K and Maj@K (unbiased estimator, n samples per problem) and print a table."""
    from deltalens.evaluation import evaluate_models
    from deltalens.evaluation.options import check_eval_options
    from deltalens.io.atomic import write_json_atomic
    from deltalens.io.outputs import Output, check_outputs
    from deltalens.presets import default_task
    from deltalens.tasks import get_task

    check_eval_options(samples=samples, ks=k, temperature=temperature, limit=limit, max_new_tokens=max_new_tokens)
    check_outputs([Output(json_out, "--json")], models=[*models, config], files=[data])
    problems = None
    if trained_on is not None:
        from deltalens.errors import DeltalensError
        from deltalens.training.trained import trained_problems

        if split is not None:
            raise DeltalensError("--trained-on replaces --split: pass one of them")
        t, problems = trained_problems(trained_on)
        if task is not None and get_task(task, data=data, question_field=question_field,
                                         answer_field=answer_field).spec != t.spec:
            raise DeltalensError(f"--task {task} differs from the task {trained_on} trained on ({t.spec}); drop --task")
        split = "trained"
    else:
        split = split or "test"
        t = get_task(task or default_task(models[0]), data=data, question_field=question_field,
                     answer_field=answer_field)
    with c.progress_bar() as bar:
        factory = c.bar_factory(bar, "eval ")
        result = evaluate_models(models, t, labels=label, config=config, dtype=dtype, samples=samples, ks=k,
                                 temperature=temperature, limit=limit, max_new_tokens=max_new_tokens,
                                 seed=seed, backend=backend, chat_template=chat_template, device=device, split=split,
                                 problems=problems, progress_factory=factory)
    first = next(iter(result["evals"].values()))
    where = f"the prompts {trained_on} trained on" if trained_on is not None else split
    table = Table(title=f"{t.name} ({where}): {first['n_problems']} problems x {samples} samples, T={temperature}"
                        f"{', chat template' if first.get('chat_template') else ''}")
    table.add_column("model")
    ks = list(first["pass_at_k"])
    mks = [kk for kk in ks if kk != "1"]  # Maj@1 is Pass@1 by definition (one sample votes alone)
    for kk in ks:
        table.add_column(f"Pass@{kk}", justify="right")
    for kk in mks:
        table.add_column(f"Maj@{kk}", justify="right")
    table.add_column("reward", justify="right")
    table.add_column("format", justify="right")
    table.add_column("gen s", justify="right")
    for lbl, r in result["evals"].items():
        table.add_row(lbl, *[f"{r['pass_at_k'][x]:.3f}" for x in ks], *[f"{r['maj_at_k'][x]:.3f}" for x in mks],
                      f"{r['mean_reward']:.3f}", f"{r['format_rate']:.2f}", f"{r['timing']['generate_s']:.1f}")
    c.console.print(table)
    if json_out is not None:
        write_json_atomic(result, json_out)
        c.console.print(f"wrote {json_out}")
