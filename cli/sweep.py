"""`deltalens sweep es|grpo`: train a grid of settings and score them on validation problems only.

    deltalens sweep es --model tiny --grid sigma=3e-3,6e-3 --grid alpha=1.5e-3,3e-3 --iterations 20 --out DIR
    deltalens sweep grpo --model tiny --grid learning_rate=2e-5,5e-5,1e-4 --steps 200 --seeds 0,1 --out DIR

    deltalens sweep es --model smollm2 --grid sigma=3e-3,6e-3 --seeds 0,1 --out DIR --ray auto --cpus-per-run 8

One subcommand per registered method (`deltalens.training.methods`); the fixed training options are
generated from its config dataclass, as in `deltalens train`, and the Ray options (--ray, --cpus-per-run,
--gpus-per-run, --ray-files) from `deltalens.study.cluster.RayOptions`, as in `deltalens study`."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from deltalens.study.cluster import RayOptions
from deltalens.training import methods

from . import common as c
from . import options as o

app = typer.Typer(name="sweep", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Choose hyperparameters on validation problems: train a grid, score every point, "
                       "with intervals against the base and the best point.")

PANEL = "Sweep"


def _params() -> list[inspect.Parameter]:
    p = functools.partial(o.param, panel=PANEL)
    return [
        p("out", Path, "--out", "-o", help="sweep directory (runs, cache, sweep.json, sweep.md)",
          default=Path("deltalens-sweep")),
        p("grid", list[str] | None, "--grid", help="an option and its values, name=v1,v2 (repeat for a product "
                                                   "grid), e.g. sigma=3e-3,6e-3"),
        p("seeds", str, "--seeds", help="training seeds of every point, comma-separated", default="0"),
        p("preset", str | None, "--preset", help="hyperparameter preset under every point: auto (the model's own), "
                                                 "paper, tiny, ..."),
        p("val_limit", int, "--val-limit", help="validation problems scored (first N)", default=200),
        p("val_samples", int, "--val-samples", help="samples per validation problem", default=8),
        p("val_temperature", float, "--val-temperature", help="sampling temperature of the scoring (0 = greedy, "
                                                             "with --val-samples 1)", default=0.6),
    ]


def _seeds(text: str) -> tuple[int, ...]:
    from deltalens.errors import DeltalensError

    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise DeltalensError(f"--seeds must be comma-separated integers (got {text!r})") from None


def show(doc: dict, out: Path) -> None:
    ev = doc["evaluation"]
    # model, task and point names are user text: Text(...) cells and titles are never read as rich markup
    t = Table(title=Text(f"sweep {doc['method']} on {doc['model']} ({doc['task']}): {ev['problems']} validation "
                         f"problems x {ev['samples']} at T={ev['temperature']}; base Pass@1 "
                         f"{doc['base']['pass_at_1']:.3f}"))
    for col in ("point", "Pass@1", "minus base [95%]", "minus best [95%]", "reward"):
        t.add_column(col, justify="left" if col == "point" else "right", overflow="fold")
    for p in doc["points"]:
        best = p["name"] == doc["best"]
        lo, hi = p["vs_best_ci"]
        t.add_row(Text(p["name"], style="bold" if best else ""), f"{p['pass_at_1']:.3f}",
                  f"{p['vs_base']:+.3f} [{p['vs_base_ci'][0]:+.3f}, {p['vs_base_ci'][1]:+.3f}]",
                  "best" if best else f"{p['vs_best']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
                  + ("" if p["within_noise_of_best"] else " *"), f"{p['mean_reward']:.3f}")
    c.console.print(t)
    if not all(p["within_noise_of_best"] for p in doc["points"]):
        c.console.print("* the interval against the best excludes 0: this point is worse than the best on "
                        "validation", highlight=False)
    c.console.print(f"sweep: {out / 'sweep.json'}, {out / 'sweep.md'}", markup=False, highlight=False)


def _make(method: str, cls):
    def body(kwargs: dict) -> None:
        from deltalens.study.sweep import Evaluation, parse_grid, run_sweep

        grid = parse_grid(method, kwargs["grid"] or [])
        ev = Evaluation(limit=kwargs["val_limit"], samples=kwargs["val_samples"],
                        temperature=kwargs["val_temperature"], seeds=_seeds(kwargs["seeds"]))
        ray = RayOptions.resolve(given=o.given(kwargs, RayOptions))  # --cpus-per-run without --ray: refused
        with c.progress_bar() as bar:
            doc = run_sweep(method, grid, o.given(kwargs, cls), kwargs["out"], preset=kwargs["preset"], ev=ev,
                            log=lambda s: c.console.print(f"[dim]{c.escape(s)}[/]"),
                            progress_factory=c.bar_factory(bar), ray=ray)
        show(doc, Path(kwargs["out"]))

    return body


for _m in methods.registered():  # es, grpo
    _name = _m.config.NAME
    app.command(_m.name)(c.guard(o.command(
        _m.name, f"Sweep {_name} settings: train every grid point, score on validation problems.",
        _params() + o.config_params(_m.config, exclude=("seed",), panel=f"{_name} options (fixed for every point)")
        + o.config_params(RayOptions, panel="Ray (docs/cluster.md)"),
        _make(_m.name, _m.config))))
