"""`deltalens report` (the analyses of a base and its fine-tunes into DIR/report.html + DIR/analysis.json) and
`deltalens render` (analysis.json -> one self-contained HTML report); registered by cli/main.py."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from . import common as c
from .diff import sparsify_warnings


def render(
    analysis_json: Annotated[Path, typer.Argument(
        help="analysis.json written by the deltalens analysis commands.", dir_okay=False)],
    output: Annotated[Path | None, typer.Option(
        "-o", "--output", dir_okay=False,
        help="HTML file to write (default: the input path with the suffix .html).")] = None,
) -> None:
    """Render an analysis.json into one self-contained HTML report that opens offline."""
    from deltalens.reports import render_file  # lazy: keeps `deltalens --help` fast

    from deltalens.io.outputs import Output, check_outputs

    check_outputs([Output(output or analysis_json.with_suffix(".html"), "-o")], files=[analysis_json])
    path = render_file(analysis_json, output)
    typer.echo(str(path))


REPORT_LIMIT = 100  # default test problems of a report's evaluations (minutes on tiny; README)


def report(
    base: Annotated[str, typer.Argument(help="the base model (any form `deltalens eval` takes)")],
    models: Annotated[list[str], typer.Argument(help="models to compare against the base: checkpoints or run dirs")],
    output: Annotated[Path | None, typer.Option(
        "-o", "--output",
        help="directory of the report: report.html, analysis.json and cache/ (default ./deltalens-report)")] = None,
    label: Annotated[list[str] | None, typer.Option("--label", help="label per model (repeat; default: file stems)")] = None,
    task: Annotated[str | None, typer.Option("--task", "-t", help="evaluate Pass@K curves on this task")] = None,
    data: Annotated[str | None, typer.Option("--data", help="jsonl file or dir (gsm8k, jsonl tasks)")] = None,
    samples: Annotated[int, typer.Option("--samples", "-n", help="samples per problem")] = 32,
    k: Annotated[str, typer.Option("--k", help="K values for the summary table")] = "1,16,32",
    temperature: Annotated[float, typer.Option("--temperature", help="sampling temperature")] = 0.6,
    limit: Annotated[int, typer.Option(
        "--limit", help=f"first N test problems of every evaluation (default {REPORT_LIMIT}: base + 2 models x "
                        "100 problems x 32 samples with 2 thresholds took 52 s on tiny on 2 CPU cores; the cost "
                        "is printed before starting)")] = REPORT_LIMIT,
    thresholds: Annotated[str | None, typer.Option(
        "--thresholds", "--sparsify", help="sparsify at these thresholds τ on |Δ|, e.g. 2.5e-4,5e-4 (as in "
                                           "`deltalens sparsify`; --sparsify: the old name)")] = None,
    sparsity: Annotated[str | None, typer.Option("--sparsity", help="target sparsities, e.g. 0.5,0.9,0.99")] = None,
    diversity: Annotated[bool, typer.Option("--diversity", help="population JS and coverage (ES runs)")] = False,
    held_out: Annotated[str | None, typer.Option("--held-out", help="held-out tasks, e.g. arith-long,arith-big")] = None,
    arch: c.Arch = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="evaluation seed (>= 0)")] = 0,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="recompute everything")] = False,
    chat_template: c.ChatTemplate = "auto",
) -> None:
    """Analyse BASE vs MODELS (diff, optional Pass@K, sparsification, diversity) into one HTML report.

    Writes DIR/report.html, DIR/analysis.json (`deltalens render` re-renders it without recomputing) and
    DIR/cache/ (results by content hash, so a rerun recomputes only what changed); DIR is -o, default
    ./deltalens-report. Bare .pt/.safetensors inputs, the base included, take their architecture from --arch.
    """
    from deltalens.reports import render_report

    from deltalens.analysis.report import DEFAULT_REPORT_DIR, build_analysis, report_paths
    from deltalens.io.atomic import write_json_atomic
    from deltalens.io.outputs import Output, check_outputs
    from deltalens.io.spec import check_arch

    arch = check_arch(arch)
    # the guard first: an -o that names an input (its state.json, a weight file) is refused as that
    check_outputs([Output(output or DEFAULT_REPORT_DIR, "-o", directory=True)], models=[base, *models, arch],
                  files=[data])
    paths = report_paths(output)
    floats = [] if not thresholds else c.parse_floats(thresholds, "--thresholds")
    targets = [] if not sparsity else c.parse_floats(sparsity, "--sparsity")
    with c.progress_bar() as bar:
        factory = c.bar_factory(bar)
        doc = build_analysis(base, models, labels=label, task=task, data=data, samples=samples, ks=k,
                             temperature=temperature, limit=limit, seed=seed, sparsify=floats,
                             sparsity_targets=targets, diversity=diversity,
                             held_out=[h for h in (held_out or "").split(",") if h], arch=arch,
                             cache_dir=None if no_cache else paths["cache"],
                             log=lambda s: c.console.print(f"[dim]{c.escape(s)}[/]"), progress_factory=factory,
                             chat_template=chat_template)
    for lbl, s in doc.get("sparsify", {}).items():
        sparsify_warnings(lbl, s)
    write_json_atomic(doc, paths["analysis"])
    render_report(doc, paths["html"])
    c.console.print(f"wrote {paths['html']} (analysis: {paths['analysis']})", markup=False)
