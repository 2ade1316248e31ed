"""`deltalens demo`: the study on the tiny model with a small budget (ES, GRPO, ES->GRPO; one seed)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from . import common as c


def demo(
    out: Annotated[str, typer.Option("--out", "-o", help="output directory")] = "deltalens-demo",
    budget: Annotated[float, typer.Option("--budget", help="training compute scale (1 = 8 ES iterations' worth)")] = 1.0,
    limit: Annotated[int, typer.Option("--limit", help="test problems evaluated per model")] = 100,
    samples: c.Samples = 32,
    seed: c.Seed = 0,
):
    """The whole study at toy scale: base, ES, GRPO, ES->GRPO; Pass@K, diff, sparsify, diversity, verdicts, report."""
    from deltalens.demo import demo_config, run_demo

    from .study import _plan, show

    plan = c.FirstWork(*_plan(demo_config(budget, limit, samples, seed), Path(out)))  # said before the first work
    with c.progress_bar() as bar:
        factory = plan.factory(c.bar_factory(bar))
        doc = run_demo(out, budget=budget, limit=limit, samples=samples, seed=seed, progress_factory=factory,
                       log=plan.log(lambda s: c.console.print(f"[dim]{c.escape(s)}[/]")))
    evals = doc["evals"]
    first = evals["base"]
    table = Table(title=f"deltalens demo: {first['task']}, {first['n_problems']} test problems x {first['samples']} "
                        "samples")
    ks = list(first["pass_at_k"])
    table.add_column("model")
    for k in ks:
        table.add_column(f"Pass@{k}", justify="right")
    table.add_column("||θ-θ0||/||θ0||", justify="right")
    for lab, ev in evals.items():
        rel = doc["diff"].get(lab, {}).get("whole", {}).get("rel_l2")
        table.add_row(lab, *[f"{ev['pass_at_k'][k]:.3f}" for k in ks], "-" if rel is None else f"{rel:.2e}")
    c.out.print(table)
    c.out.print(f"seconds: {doc['study']['seconds']}")
    show(doc, Path(out))
