"""`deltalens sweep`: choose hyperparameters on validation problems (the test split is never read).

    deltalens sweep es --model tiny --grid sigma=3e-3,6e-3,1.2e-2 --grid alpha=1.5e-3,3e-3 \
        --iterations 20 --out sweeps/es-tiny

Every point of the grid (the product of the --grid values) is a training config: the preset (the model's
own with `auto`), then the fixed options given, then the point's values. Each point is trained once per
seed into DIR/runs/<point>-s<seed> (resumable like a study: finished runs are skipped, killed ones
resume), then the base and every final model are evaluated on the first `limit` **validation**
problems (`samples` completions at `temperature`, the model's chat template setting), results cached
by the content hash of the weights in DIR/cache.

Statistics (`deltalens.analysis.stats`): per point, the paired Pass@1 difference from the base with a
95% bootstrap interval over problems and the point's seeds, and the paired difference from the best
point (highest validation Pass@1). A point whose interval against the best contains 0 is "within
noise of the best": the validation data cannot tell them apart, and the sweep says so instead of
pretending the best is a clear winner. Output: DIR/sweep.json and DIR/sweep.md (the table).

The work is a task graph (`sweep_tasks`, `deltalens.study.executor`): one task per training run and
per score, each score depending on its run only. Without --ray the graph runs in this process in plan
order (every run, then the base, then every final model), as a sweep always has; with --ray ADDRESS
(`deltalens.study.cluster`, as `deltalens study --ray`: --cpus-per-run, --gpus-per-run, --ray-files) every
task is a Ray task and a run's score starts the moment that run ends. Either way the results land in DIR
as above, so a sweep started on a cluster is resumed (or re-scored) anywhere.

Settings that decide what a point means (method, model, task, preset, fixed options, evaluation
settings) are pinned in DIR/sweep-settings.json: a rerun may add grid values or seeds, not change them.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deltalens.analysis import stats
from deltalens.analysis.report import Cache, weights_hash
from deltalens.config import Config, brief, coerce, flag_name
from deltalens.errors import DeltalensError
from deltalens.evaluation import evaluate
from deltalens.evaluation.options import check_eval_options
from deltalens.evaluation.passk import pass_at_k
from deltalens.io.atomic import atomic_path, pin_json, write_json_atomic
from deltalens.io.models import load_model
from deltalens.io.outputs import Output, check_outputs
from deltalens.io.runs import RunDir
from deltalens.presets import auto_preset, default_task
from deltalens.study.cluster import RayOptions, executor_for
from deltalens.study.executor import Executor, Task, TaskContext
from deltalens.tasks import get_task
from deltalens.training import methods
from deltalens.training.launch import check_start, train_unless_finished
from deltalens.training.run import check_finished
from deltalens.training.tracking import require

NOT_SWEPT = ("model", "task", "data", "question_field", "answer_field", "seed", "init_from", "report_to")
Log = Callable[[str], None]


@dataclass
class Evaluation:
    """How every model of a sweep is scored: validation problems only."""

    limit: int | None = 200  # first N validation problems (None: all)
    samples: int = 8  # completions per problem
    temperature: float = 0.6  # sampling temperature (0 = greedy, with samples 1)
    seeds: tuple[int, ...] = (0,)  # training seeds of every point

    def check(self) -> None:
        check_eval_options(samples=self.samples, ks=str(self.samples), temperature=self.temperature,
                           limit=self.limit, max_new_tokens=None)
        if self.temperature == 0 and self.samples != 1:
            raise DeltalensError("--val-temperature 0 is greedy: every sample is the same; use --val-samples 1")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise DeltalensError("--seeds must be distinct integers")


def parse_grid(method: str, specs: list[str]) -> dict[str, list]:
    """['sigma=3e-3,6e-3', 'alpha=1e-3'] -> {'sigma': [0.003, 0.006], 'alpha': [0.001]}, typed by the config."""
    cls = _method(method).config
    types = cls.types()
    alias = {x[2:].replace("-", "_"): f.name for f in cls.fields()
             for x in f.metadata.get("flags", ()) if x.startswith("--")}  # lr -> learning_rate, prompts -> ...
    grid: dict[str, list] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        key = alias.get(key, key)
        if not sep or not key or not values.strip():
            raise DeltalensError(f"--grid must look like name=v1,v2 (got {spec!r})")
        if key not in types or not cls.field(key).metadata.get("cli", True):
            raise DeltalensError(f"--grid {key}: {method} has no option {flag_name(key)} "
                                 f"(see `deltalens train {method} --help`)")
        if key in NOT_SWEPT:
            raise DeltalensError(f"--grid {key}: {flag_name(key)} is fixed for a whole sweep"
                                 + (" (use --seeds)" if key == "seed" else ""))
        if key in grid:
            raise DeltalensError(f"--grid names {key} twice; give all its values in one --grid")
        vals = [coerce(v.strip(), types[key], key, "--grid") for v in values.split(",") if v.strip()]
        if len(set(map(repr, vals))) != len(vals):
            raise DeltalensError(f"--grid {key} lists a value twice")
        grid[key] = vals
    if not grid:
        raise DeltalensError("give at least one --grid name=v1,v2")
    return grid


_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]+")
MAX_POINT_NAME = 80  # + "-s<seed>": far below any file system's limit on a name


def _value_text(v) -> str:
    # a float as `:g` where that is exact (the names of earlier sweeps), else its shortest exact repr
    if isinstance(v, float):
        g = f"{v:g}"
        return g if float(g) == v else repr(v)
    if isinstance(v, tuple):
        return ",".join(map(_value_text, v))
    return str(v)


def point_name(point: dict) -> str:
    """A directory name for a grid point: 'sigma=0.003_alpha=0.0015'.

    Grid values are user text (`--grid 'params=*[/../esc/]*'`), so a name holds only [A-Za-z0-9._=-],
    never '..', and at most MAX_POINT_NAME characters: where the plain name is not already that, it is a
    slug of it plus 8 hex digits of the sha256 of the exact values (distinct points, distinct names).
    """
    exact = "_".join(f"{k}={_value_text(v)}" for k, v in point.items())
    if not _UNSAFE.search(exact) and ".." not in exact and len(exact) <= MAX_POINT_NAME:
        return exact
    slug = re.sub(r"\.{2,}", ".", _UNSAFE.sub("_", exact))
    digest = hashlib.sha256(repr(sorted(point.items(), key=lambda kv: kv[0])).encode()).hexdigest()[:8]
    return f"{slug[:MAX_POINT_NAME - 9]}-{digest}"


def plan(method: str, grid: dict[str, list], fixed: dict, *, preset: str | None, ev: Evaluation,
         out: Path) -> list[dict]:
    """Every (point, seed) run with its resolved config; any bad value is refused here, before training."""
    m = _method(method)
    clash = sorted(set(grid) & set(fixed))
    if clash:
        raise DeltalensError(f"{', '.join(flag_name(k) for k in clash)} given both as a fixed option and in --grid")
    if "seed" in fixed:
        raise DeltalensError("--seed is per run in a sweep; use --seeds 0,1,2")
    runs, named = [], {}
    for values in itertools.product(*grid.values()):
        point = dict(zip(grid, values))
        name = point_name(point)
        if named.setdefault(name, point) is not point:  # e.g. 'params=a_x=b' vs 'params=a', 'x=b'
            raise DeltalensError(f"--grid points {brief(named[name])} and {brief(point)} would share the run "
                                 f"directory {name}; change one of their values")
        for seed in ev.seeds:
            cfg = m.config.resolve(preset=preset, given={**fixed, **point, "seed": seed}, source="--grid")
            total = m.total(cfg)
            run = {"point": point, "name": name, "seed": seed, "config": cfg, "total": total}
            runs.append({**run, "dir": _run_dir(out, run_key(run))})
    return runs


def _method(name: str) -> methods.Method:
    """The method a sweep trains: a single one (deltalens.training.methods), never a chain."""
    m = methods.find(name)
    if m is None:
        raise DeltalensError(f"sweep trains one of {', '.join(methods.REGISTRY)} (got {brief(name)})")
    return m


def _run_dir(out: Path, name: str) -> Path:
    """DIR/runs/NAME, refused unless it lies inside DIR/runs (point_name's names always do; a link put
    there pointing elsewhere does not)."""
    runs = out / "runs"
    d = runs / name
    if d.parent != runs or not d.resolve().is_relative_to(runs.resolve()):
        raise DeltalensError(f"{d} leads outside {runs}; remove it or choose another --out")
    return d


def _task_of(cfg: Config):
    """The task (prompts and verifier) every model of the sweep is scored on: its runs' task."""
    return get_task(cfg.task, data=cfg.data, question_field=cfg.question_field, answer_field=cfg.answer_field)


# -- the task graph: module-level functions of (ctx, ...) with picklable arguments (deltalens.study.executor)


def train_task(ctx: TaskContext, method: str, run: str, config: Config, total: int, label: str) -> dict:
    """Train (or resume) the run DIR/runs/<run> with its resolved `config` unless it is finished."""
    d = _run_dir(Path(ctx.root), run)
    train_unless_finished(d, total, label, functools.partial(_method(method).train, config, d), log=ctx.log,
                          progress_factory=ctx.progress, check_finished=functools.partial(check_finished, d, config))
    return {"run": run, "dir": f"runs/{run}", "total": total}


def score_task(ctx: TaskContext, ev: Evaluation, config: Config, label: str, *, model: str | None = None,
               run: str | None = None) -> dict:
    """Validation results of the base `model` or of run DIR/runs/<run>'s final weights (the first ev.limit
    validation problems, ev.samples completions each at ev.temperature), cached in DIR/cache by the content
    hash of the weights: {"per_problem": [[n, correct], ...], "mean_reward", "format_rate", "chat_template"}."""
    task, chat = _task_of(config), config.chat_template
    spec = model if run is None else str(RunDir(_run_dir(Path(ctx.root), run)).weights())
    cache = Cache(Path(ctx.root) / "cache")
    key = cache.key("sweep-eval", weights=weights_hash(spec), task=task.spec, limit=ev.limit,
                    samples=ev.samples, temperature=ev.temperature, chat=chat, split="validation")

    def compute():
        model_, tok = load_model(spec)
        n = len(task.validation(ev.limit)) * ev.samples
        prog = ctx.progress(f"validation {label}", n) if ctx.progress else None
        res = evaluate(model_, tok, task, samples=ev.samples, ks=[1], temperature=ev.temperature,
                       limit=ev.limit, seed=0, split="validation", chat_template=chat, progress=prog)
        return {"per_problem": [[r["n"], r["correct"]] for r in res["per_problem"]],
                "mean_reward": res["mean_reward"], "format_rate": res["format_rate"],
                "chat_template": res["chat_template"]}

    return cache.get_or_compute(key, compute, ctx.log)


def run_key(r: dict) -> str:
    """A run's directory name under DIR/runs, which its task keys carry: 'sigma=0.003-s0'."""
    return f"{r['name']}-s{r['seed']}"


def sweep_tasks(method: str, runs: list[dict], model: str, ev: Evaluation, ray: RayOptions) -> list[Task]:
    """The sweep's task graph, in the order the local executor runs it (every run, then every score):

        train:<point>-s<seed>    train (or resume) one run            outputs runs/<point>-s<seed>
        eval:base                the base on validation               outputs cache
        eval:<point>-s<seed>     one run's final model on validation  needs train:<point>-s<seed>, outputs cache

    Arguments name no path under DIR (each task finds its run under ctx.root), so the tasks also run on Ray
    workers that do not share the driver's disk; every task declares --cpus-per-run / --gpus-per-run."""
    res = ray.resources
    first = runs[0]["config"]
    tasks = [Task(f"train:{run_key(r)}", train_task, (method, run_key(r), r["config"], r["total"],
                                                      f"[{i}/{len(runs)}] {r['name']} seed {r['seed']}"),
                  kind="train", outputs=(f"runs/{run_key(r)}",), **res) for i, r in enumerate(runs, 1)]
    tasks.append(Task("eval:base", score_task, (ev, first, "base"), {"model": model}, kind="eval",
                      outputs=("cache",), **res))
    tasks += [Task(f"eval:{run_key(r)}", score_task, (ev, first, f"{r['name']} s{r['seed']}"), {"run": run_key(r)},
                   deps=(f"train:{run_key(r)}",), kind="eval", outputs=("cache",), **res) for r in runs]
    return tasks


def run_sweep(method: str, grid: dict[str, list], fixed: dict, out: str | Path, *, preset: str | None = None,
              ev: Evaluation | None = None, log: Log = print, progress_factory=None, ray: RayOptions | None = None,
              executor: Executor | None = None) -> dict:
    """Train every grid point (per seed), score all on validation, write DIR/sweep.json and DIR/sweep.md.
    ray: where the tasks run (`deltalens.study.cluster`; default: in this process, one after the other);
    executor: one given directly (tests), instead of the one `ray` asks for."""
    from deltalens.reports.markdown import sweep_markdown

    ev = ev or Evaluation()
    ev.check()
    ray = ray or RayOptions()
    out = Path(out)
    fixed = dict(fixed)
    model = fixed.get("model") or _method(method).config.field("model").default
    fixed.setdefault("task", default_task(model))
    preset = auto_preset(model) if preset in (None, "auto") else preset
    runs = plan(method, grid, fixed, preset=preset, ev=ev, out=out)
    require(runs[0]["config"].report_to)  # a missing tracker package
    check_outputs([Output(out, "--out", directory=True)], models=[model], files=[fixed.get("data")])
    first = runs[0]["config"]
    task = _task_of(first)
    if ev.limit is None and len(task.validation()) < 2 or ev.limit is not None and ev.limit < 2:
        raise DeltalensError("--val-limit must leave at least 2 validation problems (intervals need them)")
    # a missing, corrupt or incomplete model and `--chat-template on` without a template are refused before
    # DIR/sweep-settings.json pins the settings: else the corrected retry would be "a sweep with other settings"
    check_start(model, [first.chat_template])
    # so is a bad --ray-files directory; the tasks read nothing of the sweep's settings (config_files)
    executor = executor or executor_for(ray, progress_factory, log, config_files=())
    out.mkdir(parents=True, exist_ok=True)
    pinned = {k: str(v) for k, v in fixed.items() if k != "report_to"}  # tracking changes no point's meaning
    diff = pin_json({"method": method, "model": model, "preset": preset, "fixed": pinned,
                     "limit": ev.limit, "samples": ev.samples, "temperature": ev.temperature}, out / "sweep-settings.json")
    if diff:
        raise DeltalensError(f"{out} is a sweep with other settings ({', '.join(sorted(diff))} differ); use another --out")
    t0 = time.time()

    # -- training and validation scores (cached by weights): the task graph, here or on Ray
    results = executor.run(sweep_tasks(method, runs, model, ev, ray), out, log)
    base = results["eval:base"]
    finals = {(r["name"], r["seed"]): results[f"eval:{run_key(r)}"] for r in runs}
    chat = first.chat_template

    def pass1(ev_: dict) -> list[float]:
        return [pass_at_k(n, c, 1) for n, c in ev_["per_problem"]]

    base_p1 = pass1(base)
    points = []
    for name in dict.fromkeys(r["name"] for r in runs):
        mine = [r for r in runs if r["name"] == name]
        m = [pass1(finals[(name, r["seed"])]) for r in mine]
        eff = stats.paired_effect(m, [base_p1], span=1.0)
        logs = [RunDir(r["dir"]).metrics() for r in mine]
        rewards = [[row["reward_mean"] for row in lg if "reward_mean" in row] for lg in logs]
        points.append({"name": name, "values": mine[0]["point"], "seeds": [r["seed"] for r in mine],
                       "pass_at_1": eff["method"], "vs_base": eff["estimate"], "vs_base_ci": eff["ci"],
                       "mean_reward": sum(finals[(name, r["seed"])]["mean_reward"] for r in mine) / len(mine),
                       "format_rate": sum(finals[(name, r["seed"])]["format_rate"] for r in mine) / len(mine),
                       "train_reward_first_last": [[rw[0], rw[-1]] if rw else None for rw in rewards],
                       "_m": m})
    best = max(points, key=lambda p: p["pass_at_1"])
    for p in points:
        if p is best:
            p["vs_best"], p["vs_best_ci"], p["within_noise_of_best"] = 0.0, [0.0, 0.0], True
        else:
            e = stats.paired_effect(p["_m"], best["_m"], trained_base=True, span=1.0)
            p["vs_best"], p["vs_best_ci"] = e["estimate"], e["ci"]
            p["within_noise_of_best"] = bool(e["ci"][0] <= 0 <= e["ci"][1])
    for p in points:
        del p["_m"]
    points.sort(key=lambda p: -p["pass_at_1"])
    doc = {"method": method, "model": model, "task": task.spec, "preset": preset,
           "fixed": {k: v for k, v in fixed.items() if k != "task"}, "grid": grid,
           "evaluation": {"split": "validation", "problems": len(base_p1), "samples": ev.samples,
                          "temperature": ev.temperature, "chat_template": base.get("chat_template", chat),
                          "seeds": list(ev.seeds)},
           "base": {"pass_at_1": sum(base_p1) / len(base_p1), "mean_reward": base["mean_reward"],
                    "format_rate": base["format_rate"]},
           "best": best["name"], "points": points, "seconds": round(time.time() - t0, 1)}
    write_json_atomic(doc, out / "sweep.json")
    with atomic_path(out / "sweep.md") as tmp:
        tmp.write_text(sweep_markdown(doc))
    return doc
