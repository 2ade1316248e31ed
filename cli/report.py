"""`deltalens render`: analysis.json -> one self-contained HTML report (registered by cli/main.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from . import common as c


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


def report(
    base: Annotated[str, typer.Argument(help="the base model (any form `deltalens eval` takes)")],
    models: Annotated[list[str], typer.Argument(help="models to compare against the base: checkpoints or run dirs")],
    output: Annotated[Path | None, typer.Option("-o", "--output", dir_okay=False,
                                                help="HTML file (default: under the first run dir, else ./deltalens-report.html)")] = None,
    label: Annotated[list[str] | None, typer.Option("--label", help="label per model (repeat; default: file stems)")] = None,
    task: Annotated[str | None, typer.Option("--task", "-t", help="evaluate Pass@K curves on this task")] = None,
    data: Annotated[str | None, typer.Option("--data", help="jsonl file or dir (gsm8k, jsonl tasks)")] = None,
    samples: Annotated[int, typer.Option("--samples", "-n", help="samples per problem")] = 32,
    k: Annotated[str, typer.Option("--k", help="K values for the summary table")] = "1,16,32",
    temperature: Annotated[float, typer.Option("--temperature", help="sampling temperature")] = 0.6,
    limit: Annotated[int | None, typer.Option("--limit", help="first N test problems")] = None,
    sparsify: Annotated[str | None, typer.Option("--sparsify", help="thresholds τ, e.g. 2.5e-4,5e-4,1e-3")] = None,
    sparsity: Annotated[str | None, typer.Option("--sparsity", help="target sparsities, e.g. 0.5,0.9,0.99")] = None,
    diversity: Annotated[bool, typer.Option("--diversity", help="population JS and coverage (ES runs)")] = False,
    held_out: Annotated[str | None, typer.Option("--held-out", help="held-out tasks, e.g. arith-long,arith-big")] = None,
    config: Annotated[str | None, typer.Option("--config", help="architecture for bare weight files")] = None,
    seed: Annotated[int, typer.Option("--seed", help="evaluation seed")] = 0,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="recompute everything")] = False,
    chat_template: c.ChatTemplate = "auto",
) -> None:
    """Analyse BASE vs MODELS (diff, optional Pass@K, sparsification, diversity) into one HTML report.

    Results are cached as JSON next to the report (by content hash), and analysis.json is written
    beside the HTML so `deltalens render` can re-render without recomputing.
    """
    from deltalens.reports import render_report

    from deltalens.analysis.report import build_analysis, default_report_path
    from deltalens.errors import DeltalensError
    from deltalens.io.atomic import write_json_atomic
    from deltalens.io.outputs import Output, check_outputs


    out = output or default_report_path(models)
    floats = [] if not sparsify else c.parse_floats(sparsify, "--sparsify")
    targets = [] if not sparsity else c.parse_floats(sparsity, "--sparsity")
    if out.suffix in (".json", ".cache"):  # the analysis and the cache are named after -o with these suffixes
        raise DeltalensError(f"-o {out}: the report's analysis goes to {out.with_suffix('.json')} and its cache "
                             f"to {out.with_suffix('.cache')}; give -o an .html name")
    check_outputs([Output(out, "-o"), Output(out.with_suffix(".json"), "the analysis JSON"),
                   None if no_cache else Output(out.with_suffix(".cache"), "the cache", directory=True)],
                  models=[base, *models, config], files=[data])
    with c.progress_bar() as bar:
        factory = c.bar_factory(bar)
        doc = build_analysis(base, models, labels=label, task=task, data=data, samples=samples, ks=k,
                             temperature=temperature, limit=limit, seed=seed, sparsify=floats,
                             sparsity_targets=targets, diversity=diversity,
                             held_out=[h for h in (held_out or "").split(",") if h], config=config,
                             cache_dir=None if no_cache else out.with_suffix(".cache"),
                             log=lambda s: c.console.print(f"[dim]{c.escape(s)}[/]"), progress_factory=factory,
                             chat_template=chat_template)
    write_json_atomic(doc, out.with_suffix(".json"))
    render_report(doc, out)
    c.console.print(f"wrote {out} (analysis: {out.with_suffix('.json')})")
