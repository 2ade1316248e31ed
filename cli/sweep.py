"""`deltalens sweep es|grpo`: train a grid of settings and score them on validation problems only.

    deltalens sweep es --model tiny --grid sigma=3e-3,6e-3 --grid alpha=1.5e-3,3e-3 --iterations 20 --out DIR
    deltalens sweep grpo --model tiny --grid learning_rate=2e-5,5e-5,1e-4 --steps 200 --seeds 0,1 --out DIR

    deltalens sweep es --model smollm2 --grid sigma=3e-3,6e-3 --seeds 0,1 --out DIR --ray auto --cpus-per-run 8

    deltalens sweep es --config sweep.yaml --out DIR   # grid: {sigma: [3.0e-3, 6.0e-3]}, seeds: [0, 1], iterations: 20

One subcommand per registered method (`deltalens.training.methods`); every option is generated from a config
dataclass: the sweep's own (grid, seeds, preset, validation scoring) from `deltalens.study.config.SweepConfig`, the fixed training
options from the method's config, as in `deltalens train`, and the Ray options (--ray, --cpus-per-run,
--gpus-per-run, --ray-files) from `deltalens.study.cluster.RayOptions`, as in `deltalens study`. `--config
FILE` holds any of them in one mapping (`deltalens.cli.options.split_options`); flags override it."""

from __future__ import annotations

import inspect
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from deltalens.study.cluster import RayOptions
from deltalens.study.config import SweepConfig
from deltalens.training import methods

from . import common as c
from . import options as o

app = typer.Typer(name="sweep", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Choose hyperparameters on validation problems: train a grid, score every point, "
                       "with intervals against the base and the best point.")

PANEL = "Sweep"


def _params(method) -> list[inspect.Parameter]:
    out = o.param("out", Path, "--out", "-o", help="sweep directory (runs, cache, sweep.json, sweep.md)",
                  default=Path("deltalens-sweep"), panel=PANEL)
    return [out, *o.config_params(SweepConfig, panel=PANEL),
            o.config_file_param("sweep", "grid: {sigma: [3.0e-3, 6.0e-3]}, iterations: 20", arch=False, panel=PANEL),
            *o.config_params(method.config, exclude=("seed",), panel=f"{method.config.NAME} options (fixed for "
                                                                       "every point)"),
            *o.config_params(RayOptions, panel="Ray (docs/cluster.md)")]


def _grid_text(grid) -> list:
    """A --config `grid` as --grid's words: a mapping name: [v1, v2] -> ['name=v1,v2'], one string -> [it]."""
    if isinstance(grid, dict):
        return [f"{k}={','.join(map(str, v if isinstance(v, (list, tuple)) else [v]))}" for k, v in grid.items()]
    return [grid] if isinstance(grid, str) else grid


def _options(method, kwargs: dict) -> tuple[SweepConfig, dict, RayOptions]:
    """(the sweep's own options, the method's fixed options, the Ray options): each from the --config file under
    the flags given; a key of the file none of them has, a wrong type, an unused option: refused in one line."""
    cls = method.config
    path = kwargs.get("config_file")
    parts = {"sweep": {}, "method": {}, "ray": {}}
    if path is not None:
        what = f"sweep {method.name}"
        data = o.options_file(path, what, arch=False)
        if "grid" in data:
            data = {**data, "grid": _grid_text(data["grid"])}
        parts = o.split_options(data, {"sweep": SweepConfig, "method": cls, "ray": RayOptions}, str(path), what)
    own = SweepConfig.resolve(yaml=parts["sweep"], given=o.given(kwargs, SweepConfig), source=str(path))
    ray = RayOptions.resolve(yaml=parts["ray"], given=o.given(kwargs, RayOptions), source=str(path))
    cls.check_keys(parts["method"], str(path))  # wrong types refused here, naming the file
    # the file's values as the command line gives them (a list as v1,v2), so sweep-settings.json pins the same text
    fixed = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in parts["method"].items()}
    return own, {**fixed, **o.given(kwargs, cls)}, ray


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
                        "validation" + (" (over problems only: one training seed per point, see sweep.md)"
                                        if len(ev["seeds"]) == 1 else ""), highlight=False)
    c.console.print(f"sweep: {out / 'sweep.json'}, {out / 'sweep.md'}", markup=False, highlight=False)


def _make(method):
    def body(kwargs: dict) -> None:
        from deltalens.study.sweep import Evaluation, parse_grid, run_sweep

        own, fixed, ray = _options(method, kwargs)  # --cpus-per-run without --ray: refused
        grid = parse_grid(method.name, list(own.grid))
        ev = Evaluation(limit=own.val_limit, samples=own.val_samples, temperature=own.val_temperature,
                        seeds=own.seeds)
        with c.progress_bar() as bar:
            doc = run_sweep(method.name, grid, fixed, kwargs["out"], preset=own.preset, ev=ev,
                            log=lambda s: c.console.print(f"[dim]{c.escape(s)}[/]"),
                            progress_factory=c.bar_factory(bar), ray=ray)
        show(doc, Path(kwargs["out"]))

    return body


for _m in methods.registered():  # es, grpo
    app.command(_m.name)(c.guard(o.command(
        _m.name, f"Sweep {_m.config.NAME} settings: train every grid point, score on validation problems.",
        _params(_m), _make(_m))))
