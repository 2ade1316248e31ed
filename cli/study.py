"""`deltalens study MODEL`: train every method for every seed at one budget, measure, and give each claim of
arXiv 2608.27351 a verdict with bootstrap intervals. Options are generated from `deltalens.study.StudyConfig`."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from deltalens.study.config import StudyConfig

from . import common as c
from . import options as o


def show(doc: dict, out: Path) -> None:
    """The verdict table on the terminal."""
    study = doc["study"]
    t = Table(title=f"deltalens study: {study['config']['model']} on {study['config']['task']}")
    for col in ("claim", "check", "estimate", "95% interval", "verdict"):
        t.add_column(col, justify="right" if col in ("estimate", "95% interval") else "left")
    for cl in study["claims"]:
        t.add_row(f"({cl['id']})", cl["title"][:60], "", "", f"[bold]{cl['verdict']}[/]")
        for ch in cl["checks"]:
            est, lo, hi = ch["estimate"], ch["ci_low"], ch["ci_high"]
            t.add_row("", ch["check"], "-" if est is None else f"{est:.3g}",
                      "-" if lo is None or hi is None else f"[{lo:.3g}, {hi:.3g}]", ch["verdict"])
    c.console.print(t)
    c.console.print(study["rule"], highlight=False)
    c.console.print(f"report: {out / 'report.html'}  analysis: {out / 'analysis.json'}  verdicts: "
                    f"{out / 'verdicts.csv'}, {out / 'verdicts.md'}")


def _run(kwargs: dict) -> None:
    from deltalens.study.run import run_study

    given = o.given(kwargs, StudyConfig)
    cfg = StudyConfig.resolve(given={**given, "model": kwargs["model"]})
    out = kwargs["out"]
    with c.progress_bar() as bar:
        factory = c.bar_factory(bar)
        doc = run_study(cfg, out, log=lambda s: c.console.print(f"[dim]{c.escape(s)}[/]"), progress_factory=factory)
    show(doc, Path(out))


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
