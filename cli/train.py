"""`deltalens train es|grpo|chain|resume`: fine-tune a model into a run directory.

    deltalens train es --model tiny --task arith --out runs/es --iterations 30
    deltalens train grpo --model tiny --out runs/grpo --budget 1e6
    deltalens train chain --methods es,grpo --out runs/es-grpo --budget 1e6 --es-sigma 6e-3 --grpo-lr 5e-5
    deltalens train es --config run.yaml --out runs/x          # YAML supplies values; flags override it
    deltalens train es --config runs/es/config.json --out runs/y  # a run's config.json: the same run again
    deltalens train resume runs/es [--iterations 60]            # continue a killed (or finished) run

One subcommand per registered method (`deltalens.training.methods`: es, grpo), then `chain` and `resume`.
Every option of a method and the stage options of `chain` (`--es-*`, `--grpo-*`: one prefix per stage
method of the registry) is generated from the config dataclasses (`deltalens.training.es.ESConfig`,
`...grpo.GRPOConfig`, `...chain.ChainConfig`), help text included. An option a method does not have is
refused by the parser; one it has but does not use in this configuration (e.g. `--workers` without `--backend ray`),
an unknown YAML key or a value of the wrong type is refused with one line, before anything is written.

The old form `deltalens train --method es|grpo|es-grpo|grpo-es ...` still works: `cli/main.py`
rewrites it to the subcommand (es-grpo -> `chain --methods es,grpo`), and `--resume DIR` alone to
`resume DIR`.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Annotated

import typer

from deltalens.methods import chain_stages, stage_names
from deltalens.training import methods
from deltalens.training.chain import CHAIN_OWNED, ChainConfig

from . import common as c
from . import options as o

app = typer.Typer(name="train", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Fine-tune a model (ES, GRPO, or a chain of both) into a run directory.")

RUN_PANEL = "Run"


def _run_params(presets) -> list[inspect.Parameter]:
    """Options every new-run command has besides its config fields; `presets`: the names --preset takes."""
    p = functools.partial(o.param, panel=RUN_PANEL)
    names = ", ".join(dict.fromkeys(presets))
    return [
        p("out", Path | None, "--out", "-o", help="run directory to create"),
        p("resume", Path | None, "--resume", help="continue the run in this directory (its settings, plus the "
                                                  "options given, which may not change its trajectory)"),
        p("config_file", Path | None, "--config", help="YAML (or JSON) file of options, or a run's config.json (the "
                                                       "same run again); flags given here override it"),
        p("preset", str | None, "--preset", help=f"hyperparameter preset: auto (the model's own, else paper), "
                                                 f"{names}"),
        p("overwrite", bool, "--overwrite", help="replace an existing run in --out", default=False),
    ]


def _progress_bar(label: str):
    """(context manager, progress callback) for a training run's bar."""
    bar = c.progress_bar()
    state = {}

    def progress(done: int, total: int, row: dict | None) -> None:
        if "tid" not in state:
            state["tid"] = bar.add_task(label, total=None)
        desc = f"{label} it {done}/{total}"
        if row is not None:
            desc += (f"  reward {row['reward_mean']:.3f} (max {row['reward_max']:.3f})"
                     f"  {row['timing']['iteration_s']:.1f} s/it")
            if "eval" in row:
                desc += f"  pass@1 {row['eval']['pass_at_1']:.3f}"
        bar.update(state["tid"], completed=done, total=total, description=desc)

    return bar, progress


def _run(method: str, kwargs: dict, given: dict) -> None:
    from deltalens.training.launch import start

    bar, progress = _progress_bar(method)
    with bar:
        run_dir = start(method, out=kwargs["out"], resume=kwargs["resume"], given=given,
                        yaml_path=kwargs["config_file"], preset=kwargs["preset"], overwrite=kwargs["overwrite"],
                        progress=progress)
    summary(Path(run_dir))


def _single(method: methods.Method):
    def body(kwargs: dict) -> None:
        _run(method.name, kwargs, o.given(kwargs, method.config))

    return body


def _chain(kwargs: dict) -> None:
    given = o.given(kwargs, ChainConfig)
    for method in stage_names():
        stage = o.given(kwargs, methods.get(method).config, prefix=f"{method}_")
        if stage:
            given[method] = stage
    _run("chain", kwargs, given)


def _stage_params() -> list[inspect.Parameter]:
    """--es-sigma, --grpo-learning-rate, ...: every chain stage's options less those the chain sets itself."""
    out = []
    for m in stage_names():
        cls = methods.get(m).config
        out += o.config_params(cls, prefix=f"{m}_", exclude=CHAIN_OWNED, panel=f"{cls.NAME} stage options")
    return out


for _m in methods.registered():  # es, grpo: one subcommand per registered method
    app.command(_m.name)(c.guard(o.command(
        _m.name, _m.summary, _run_params(_m.config.PRESETS) + o.config_params(_m.config, panel=f"{_m.config.NAME} options"),
        _single(_m))))
app.command("chain")(c.guard(o.command(
    "chain", "ES then GRPO (or GRPO then ES, or any sequence of stage methods) as one run directory; --budget is "
             "split between the stages.",
    _run_params(p for m in stage_names() for p in methods.get(m).config.PRESETS)
    + o.config_params(ChainConfig, panel="Chain options") + _stage_params(), _chain)))


@app.command("resume")
@c.guard
def resume(
    run_dir: Annotated[Path, typer.Argument(help="the run directory to continue (its method is read from it)")],
    iterations: Annotated[int | None, typer.Option("--iterations", help="ES: total iterations (grow a run)")] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="GRPO: total steps (grow a run; constant LR only)")
                     ] = None,
):
    """Continue a killed (or finished) run with its own method and settings."""
    from deltalens.training.launch import resume_run

    given = {k: v for k, v in {"iterations": iterations, "steps": steps}.items() if v is not None}
    bar, progress = _progress_bar(run_dir.name)
    with bar:
        out = resume_run(run_dir, given=given, progress=progress)
    summary(Path(out))


def summary(run_dir: Path) -> None:
    from deltalens.io.runs import RunDir

    rows = RunDir(run_dir).metrics()
    train_rows = [r for r in rows if "reward_mean" in r]
    evals = [(r["iteration"], r["eval"]["pass_at_1"]) for r in rows if "eval" in r]
    msg = f"run: {run_dir}"
    if train_rows:
        last = train_rows[-1]
        msg += f"  iterations {last['iteration']}  reward {train_rows[0]['reward_mean']:.3f} -> {last['reward_mean']:.3f}"
    if evals:
        msg += f"  held-out pass@1 {evals[0][1]:.3f} (it {evals[0][0]}) -> {evals[-1][1]:.3f} (it {evals[-1][0]})"
    c.console.print(msg, highlight=False, markup=False)  # the run directory is user text
    typer.echo(str(run_dir))


def rewrite_alias(args: list[str]) -> list[str]:
    """`train --method M ...` -> `train <subcommand> ...`; `train --resume DIR` -> `train resume DIR`.

    `args` are the words after `train`. Anything else is returned unchanged.
    """
    if not args or not args[0].startswith("-") or args[0] in ("--help", "-h"):
        return args
    rest, method = [], None
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--method", "-m") and i + 1 < len(args):
            method, i = args[i + 1], i + 2
            continue
        if a.startswith("--method="):
            method = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    if method is None:
        if "--resume" in rest and not any(x.startswith("--") and x != "--resume" for x in rest):
            j = rest.index("--resume")
            return ["resume", *rest[j + 1:j + 2]]
        method = "es"  # the old default
    stages = chain_stages(method)  # es-grpo -> chain --methods es,grpo
    return [*(["chain", "--methods", ",".join(stages)] if stages else [method]), *rest]
