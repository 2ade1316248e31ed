"""`deltalens demo`: the study on the tiny model with a small budget (ES, GRPO, ES->GRPO; one seed). Its options
are generated from `deltalens.demo.DemoConfig` (cli/options.py), so `--config FILE` takes them as every command
does."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from deltalens.demo import DemoConfig

from . import common as c
from . import options as o


def _run(kwargs: dict) -> None:
    from deltalens.demo import demo_config, run_demo

    from .study import _plan, show

    cfg = o.resolve(DemoConfig, kwargs, arch=False)
    out = kwargs["out"]
    args = {"budget": cfg.budget, "limit": cfg.limit, "samples": cfg.samples, "seed": cfg.seed}
    plan = c.FirstWork(*_plan(demo_config(**args), Path(out)))  # said before the first work
    with c.progress_bar() as bar:
        factory = plan.factory(c.bar_factory(bar))
        doc = run_demo(out, **args, progress_factory=factory,
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


OUT = inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, default="deltalens-demo",
                        annotation=Annotated[str, typer.Option("--out", "-o", help="output directory")])

demo = o.command("demo", "The whole study at toy scale: base, ES, GRPO, ES->GRPO; Pass@K, diff, sparsify, diversity, "
                 "verdicts, report.", [OUT, *o.config_params(DemoConfig), o.config_file_param("demo", "budget: 2",
                                                                                          arch=False)], _run)
