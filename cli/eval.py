"""`deltalens eval`: Pass@K / Maj@K of one or more models on a task.

The table goes to stdout (with `--json FILE` the whole analysis document to FILE), everything else to
stderr: first a note when --k asks for more than --samples (those Ks become --samples), then the plan
line (models x problems x samples, and an estimate from a rate measured here: `deltalens.evaluation.cost`)
once the first model has loaded and before it generates, then progress. Each Pass@K has its standard error over problems beside it.
`--log-samples FILE` writes every completion as JSONL (`deltalens.evaluation.samples`).
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from deltalens.evaluation.options import EvalConfig

from . import common as c
from . import options as o

MODELS = inspect.Parameter("models", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[
    list[str], typer.Argument(help="models: tiny, smollm2, HF dir, run dir, hub id, .gguf, .pt, .safetensors")])


def _eval(kwargs: dict) -> None:
    cfg = o.resolve(EvalConfig, kwargs)
    run_eval(kwargs["models"], cfg)


def run_eval(models: list[str], cfg: EvalConfig) -> None:
    """The command's work on its resolved options: checks, plan line, evaluation, table, outputs."""
    from deltalens.evaluation import evaluate_models
    from deltalens.evaluation.cost import plan_line
    from deltalens.evaluation.options import check_eval_options
    from deltalens.evaluation.passk import fit_ks, parse_ks
    from deltalens.evaluation.samples import SampleLog
    from deltalens.io.atomic import write_json_atomic
    from deltalens.io.hub import model_options
    from deltalens.io.outputs import Output, check_outputs
    from deltalens.io.spec import resolve
    from deltalens.presets import default_task
    from deltalens.tasks import get_task

    task, samples, k, temperature, limit = cfg.task, cfg.samples, cfg.k, cfg.temperature, cfg.limit
    data, question_field, answer_field, config = cfg.data, cfg.question_field, cfg.answer_field, cfg.arch
    dtype, compute_dtype, max_new_tokens, seed, backend = (cfg.dtype, cfg.compute_dtype, cfg.max_new_tokens,
                                                           cfg.seed, cfg.backend)
    chat_template, split, trained_on, device = cfg.chat_template, cfg.split, cfg.trained_on, cfg.device
    json_out, log_samples = _path(cfg.json), _path(cfg.log_samples)
    label = list(cfg.label) or None
    check_eval_options(samples=samples, temperature=temperature, limit=limit, max_new_tokens=max_new_tokens)
    ks, note = fit_ks(parse_ks(k), samples)
    check_outputs([Output(json_out, "--json"), Output(log_samples, "--log-samples")], models=[*models, config],
                  files=[data])
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
    for spec in models:  # a hub model the hub cannot give is refused now, in one line (deltalens.io.hub)
        if resolve(spec).kind == "hub":
            model_options(str(spec))
    if note:
        c.console.print(f"[yellow]note:[/] {c.escape(note)}", highlight=False, soft_wrap=True)
    n_problems = len(t.split(split, limit) if problems is None else list(problems)[:limit])
    # said once the first model has loaded, before it generates (c.FirstWork)
    plan = c.FirstWork(plan_line(what="eval", models=len(models), problems=n_problems, samples=samples,
                                 max_new_tokens=max_new_tokens or t.max_new_tokens, model=models[0],
                                 backend=backend, dtype=dtype, device=device, config=config,
                                 compute_dtype=compute_dtype))
    with contextlib.ExitStack() as stack:
        slog = stack.enter_context(SampleLog(log_samples, t)) if log_samples is not None else None
        bar = stack.enter_context(c.progress_bar())
        result = evaluate_models(models, t, labels=label, config=config, dtype=dtype, samples=samples, ks=ks,
                                 temperature=temperature, limit=limit, max_new_tokens=max_new_tokens,
                                 seed=seed, backend=backend, chat_template=chat_template, device=device, split=split,
                                 problems=problems, progress_factory=plan.factory(c.bar_factory(bar, "eval ")),
                                 on_samples=None if slog is None else slog.add, compute_dtype=compute_dtype)
    first = next(iter(result["evals"].values()))
    where = f"the prompts {trained_on} trained on" if trained_on is not None else split
    table = Table(title=f"{t.spec} ({where}): {first['n_problems']} problems x {samples} samples, T={temperature}"
                        f"{', chat template' if first.get('chat_template') else ''}")
    table.add_column("model")
    ks = list(first["pass_at_k"])
    mks = [kk for kk in ks if kk != "1"]  # Maj@1 is Pass@1 by definition (one sample votes alone)
    for kk in ks:
        table.add_column(f"Pass@{kk}", justify="right")
        table.add_column(f"SE@{kk}", justify="right", style="dim")
    for kk in mks:
        table.add_column(f"Maj@{kk}", justify="right")
    table.add_column("reward", justify="right")
    table.add_column("format", justify="right")
    table.add_column("gen s", justify="right")
    for lbl, r in result["evals"].items():
        passes = [cell for x in ks for cell in (f"{r['pass_at_k'][x]:.3f}", _se(r["pass_at_k_se"][x]))]
        table.add_row(lbl, *passes, *[f"{r['maj_at_k'][x]:.3f}" for x in mks],
                      f"{r['mean_reward']:.3f}", f"{r['format_rate']:.2f}", f"{r['timing']['generate_s']:.1f}")
    c.out.print(table, width=max(c.out.width, 160) if not c.out.is_terminal else None)
    if slog is not None:
        c.console.print(f"wrote {c.escape(str(log_samples))} ({slog.lines} completions)", highlight=False)
    if json_out is not None:
        write_json_atomic(result, json_out)
        c.console.print(f"wrote {json_out}", markup=False)


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)


eval_cmd = o.command("eval", "Evaluate Pass@K (with its standard error over problems) and Maj@K (unbiased estimator, "
                     "n samples per problem); the table goes to stdout, logs and progress to stderr.",
                     [MODELS, *o.config_params(EvalConfig), o.config_file_param("eval")], _eval)


def _se(se: float | None) -> str:
    """A standard error for the table ('-' for one problem, where it is undefined)."""
    return "-" if se is None else f"{se:.3f}"
