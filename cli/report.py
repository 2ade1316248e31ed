"""`deltalens report` (the analyses of a base and its fine-tunes into DIR/report.html + DIR/analysis.json) and
`deltalens render` (analysis.json -> one self-contained HTML report); registered by cli/main.py."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer

from deltalens.analysis.options import REPORT_LIMIT, ReportConfig

from . import common as c
from . import options as o
from .diff import sparsify_warnings

__all__ = ["REPORT_LIMIT", "render", "report"]


def render(
    analysis_json: Annotated[Path, typer.Argument(
        help="analysis.json written by the deltalens analysis commands (or a published analysis.json.gz).", dir_okay=False)],
    output: Annotated[Path | None, typer.Option(
        "--out", "-o", "--output", dir_okay=False,
        help="HTML file to write (default: the input path with the suffix .html; analysis.json.gz -> analysis.html) (--output: the old name)")] = None,
) -> None:
    """Render an analysis.json into one self-contained HTML report that opens offline."""
    from deltalens.reports import default_html, render_file  # lazy: keeps `deltalens --help` fast

    from deltalens.io.outputs import Output, check_outputs

    check_outputs([Output(output or default_html(analysis_json), "--out")], files=[analysis_json])
    path = render_file(analysis_json, output)
    typer.echo(str(path))


BASE = inspect.Parameter("base", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[
    str, typer.Argument(help="the base model (any form `deltalens eval` takes)")])
MODELS = inspect.Parameter("models", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[
    list[str], typer.Argument(help="models to compare against the base: checkpoints or run dirs")])


def _report(kwargs: dict) -> None:
    cfg = o.resolve(ReportConfig, kwargs)
    run_report(kwargs["base"], kwargs["models"], cfg)


def run_report(base: str, models: list[str], cfg: ReportConfig) -> None:
    """Analyse BASE vs MODELS into DIR/report.html, DIR/analysis.json and DIR/cache/ (the command's work)."""
    from deltalens.reports import render_report

    from deltalens.analysis.report import DEFAULT_REPORT_DIR, build_analysis, report_paths
    from deltalens.io.atomic import write_json_atomic
    from deltalens.io.outputs import Output, check_outputs
    from deltalens.io.spec import check_arch

    output = None if cfg.out is None else Path(cfg.out)
    arch, task, data, thresholds, sparsity, held_out = (cfg.arch, cfg.task, cfg.data, cfg.thresholds, cfg.sparsity,
                                                        cfg.held_out)
    arch = check_arch(arch)
    # the guard first: an --out that names an input (its state.json, a weight file) is refused as that
    check_outputs([Output(output or DEFAULT_REPORT_DIR, "--out", directory=True)], models=[base, *models, arch],
                  files=[data])
    paths = report_paths(output)
    floats = [] if thresholds is None else c.parse_floats(thresholds, "--thresholds", empty=True)
    targets = [] if sparsity is None else c.parse_floats(sparsity, "--sparsity", empty=True)
    with c.progress_bar() as bar:
        factory = c.bar_factory(bar)
        doc = build_analysis(base, models, labels=list(cfg.label) or None, task=task, data=data, samples=cfg.samples,
                             ks=cfg.k, temperature=cfg.temperature, limit=cfg.limit, seed=cfg.seed, sparsify=floats,
                             sparsity_targets=targets, diversity=cfg.diversity,
                             held_out=[h for h in (held_out or "").split(",") if h], arch=arch,
                             cache_dir=None if cfg.no_cache else paths["cache"],
                             log=lambda s: c.console.print(f"[dim]{c.escape(s)}[/]"), progress_factory=factory,
                             chat_template=cfg.chat_template, compute_dtype=cfg.compute_dtype)
    for lbl, s in doc.get("sparsify", {}).items():
        sparsify_warnings(lbl, s)
    write_json_atomic(doc, paths["analysis"])
    render_report(doc, paths["html"])
    c.console.print(f"wrote {paths['html']} (analysis: {paths['analysis']})", markup=False)


report = o.command("report", """Analyse BASE vs MODELS (diff, optional Pass@K, sparsification, diversity) into one HTML report.

    Writes DIR/report.html, DIR/analysis.json (`deltalens render` re-renders it without recomputing) and
    DIR/cache/ (results by content hash, so a rerun recomputes only what changed); DIR is --out, default
    ./deltalens-report. Bare .pt/.safetensors inputs, the base included, take their architecture from --arch.
    """, [BASE, MODELS, *o.config_params(ReportConfig), o.config_file_param("report")], _report)
