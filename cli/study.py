"""`deltalens study MODEL`: train every method for every seed at one budget, measure, and give each claim of
arXiv 2608.27351 a verdict with bootstrap intervals. Options are generated from `deltalens.study.StudyConfig`."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from deltalens.study.config import StudyConfig

from . import common as c
from . import options as o


def show(doc: dict, out: Path, console=None) -> None:
    """The verdict table, on stdout: it fits an 80-column terminal, each claim's full text wrapping on its own
    row above its checks (nothing is cut), numbers to 3 significant digits."""
    console = console or c.out
    study = doc["study"]
    t = Table(title=Text(f"deltalens study: {study['config']['model']} on {study['config']['task']}"),  # user text
              expand=False, pad_edge=False)
    t.add_column("check", overflow="fold", ratio=1, min_width=24)
    t.add_column("estimate", justify="right", no_wrap=True)
    t.add_column("95% interval", justify="right", no_wrap=True)
    t.add_column("verdict", no_wrap=True)
    for cl in study["claims"]:
        t.add_row(Text(f"({cl['id']}) {cl['title']}", style="bold"), "", "", Text(cl["verdict"], style="bold"))
        if cl.get("note"):  # a paper claim the study did not run: the option that runs it
            t.add_row(Text("  " + cl["note"]), "", "", "")
        for ch in cl["checks"]:
            est, lo, hi = ch["estimate"], ch["ci_low"], ch["ci_high"]
            t.add_row(Text("  " + ch["check"]), "-" if est is None else f"{est:.3g}",
                      "-" if lo is None or hi is None else f"[{lo:.3g}, {hi:.3g}]", Text(ch["verdict"]))
    console.print(t)
    console.print(study["rule"], markup=False, highlight=False)
    c.console.print(f"report: {out / 'report.html'}  analysis: {out / 'analysis.json'}  verdicts: "
                    f"{out / 'verdicts.csv'}, {out / 'verdicts.md'}", markup=False, highlight=False)


def _run(kwargs: dict) -> None:
    from deltalens.study.run import run_study

    given = o.given(kwargs, StudyConfig)
    cfg = StudyConfig.resolve(given={**given, "model": kwargs["model"]})
    out = kwargs["out"]
    # said once the study's own up-front checks passed (a refusal stays one line): at its first log line or
    # progress bar, which come before any training or evaluation
    plan = c.FirstWork(*_plan(cfg, Path(out)))
    with c.progress_bar() as bar:
        doc = run_study(cfg, out, log=plan.log(lambda s: c.console.print(f"[dim]{c.escape(s)}[/]")),
                        progress_factory=plan.factory(c.bar_factory(bar)))
    show(doc, Path(out))


def _plan(cfg: StudyConfig, out: Path) -> list[str]:
    """The study's evaluations, stated before it starts (`deltalens.evaluation.cost`): Pass@K of the base
    (each sampling seed) and of every run, and the sparsity sweeps (full update, then threshold, random mask
    and shrink at each sparsity) of the first seed's ES and GRPO runs. Training comes on top. Nothing when
    the task cannot be built: the study reports that itself."""
    from deltalens.errors import DeltalensError
    from deltalens.evaluation.cost import plan_line
    from deltalens.tasks import get_task

    try:
        task = get_task(cfg.task)
        problems = len(task.test(cfg.limit))
    except DeltalensError:
        return []
    common = {"problems": problems, "max_new_tokens": task.max_new_tokens, "model": cfg.model,
              "backend": cfg.backend, "device": "cpu"}
    runs = len(cfg.methods) * len(cfg.seeds)
    lines = [plan_line(what=f"study Pass@K (the base at {cfg.base_seeds} sampling seeds, {runs} runs)",
                       models=cfg.base_seeds + runs, samples=cfg.samples, **common)]
    sparse_runs = sum(m in ("es", "grpo") for m in cfg.methods)
    if sparse_runs and cfg.sparsity:
        lines.append(plan_line(what="study sparsity", models=sparse_runs, points=1 + 3 * len(cfg.sparsity),
                               samples=cfg.sparsify_samples, **common))
    if (out / "cache").is_dir():
        lines.append(f"(a rerun: what {out / 'cache'} already holds is not computed again)")
    return lines


def _params() -> list[inspect.Parameter]:
    model = inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              annotation=Annotated[str, typer.Argument(help="base model spec: tiny, smollm2, HF dir, "
                                                                            ".gguf, hub id")])
    out = inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, default=Path("deltalens-study"),
                            annotation=Annotated[Path, typer.Option("--out", "-o", help="study directory (runs, "
                                                                    "cache, analysis.json, report.html)")])
    return [model, out, *o.config_params(StudyConfig)]


study = o.command("study", "Train every method for every seed at one FLOP-matched budget, measure, and test each "
                  "claim of arXiv 2608.27351 with bootstrap intervals; resumable.", _params(), _run)
