"""`deltalens demo`: train ES, GRPO and ES->GRPO on the tiny model, evaluate, analyse, report."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from . import common as c


def demo(
    out: Annotated[str, typer.Option("--out", "-o", help="output directory")] = "deltalens-demo",
    budget: Annotated[float, typer.Option("--budget", help="training compute scale (1 = ~10 min on 2 cores)")] = 1.0,
    limit: Annotated[int, typer.Option("--limit", help="test problems evaluated per model")] = 100,
    samples: c.Samples = 32,
    seed: c.Seed = 0,
):
    """The whole study at toy scale: base, ES, GRPO, ES->GRPO; Pass@K, diff, sparsify, diversity, report."""
    from pathlib import Path

    from deltalens.demo import DemoConfig, run_demo
    from deltalens.io.outputs import Output, check_outputs

    check_outputs([Output(Path(out), "--out", directory=True)], models=["tiny"])
    cfg = DemoConfig(out=out, budget=budget, limit=limit, samples=samples, seed=seed)
    with c.progress_bar() as bar:
        def factory(desc, total):
            tid = bar.add_task(desc, total=total)
            return lambda done, _t=None: bar.update(tid, completed=done)

        doc = run_demo(cfg, progress_factory=factory, log=lambda s: c.console.print(f"[dim]{c.escape(s)}[/]"))
    table = Table(title=f"deltalens demo: {doc['evals']['base']['task']}, {limit} test problems x {samples} samples")
    ks = list(doc["evals"]["base"]["pass_at_k"])
    table.add_column("model")
    for k in ks:
        table.add_column(f"Pass@{k}", justify="right")
    table.add_column("||θ-θ0||/||θ0||", justify="right")
    for lab, ev in doc["evals"].items():
        rel = doc["diff"].get(lab, {}).get("whole", {}).get("rel_l2")
        table.add_row(lab, *[f"{ev['pass_at_k'][k]:.3f}" for k in ks], "-" if rel is None else f"{rel:.2e}")
    c.console.print(table)
    t = doc["demo"]["timings_s"]
    c.console.print(f"timings (s): {t}")
    c.console.print(f"report: {out}/report.html")
