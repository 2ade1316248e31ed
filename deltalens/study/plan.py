"""A study's task graph: everything it computes, as `deltalens.study.executor.Task`s.

`study_tasks(cfg, plan)` turns the run plan (`deltalens.study.runs`) into tasks, each a module-level
function taking (ctx, cfg, ...) with picklable arguments, in the order a local study has always run them:

    train:<label>                       train (or resume) one run                   outputs runs/<label>
    eval:base:s<seed>:t<T>              the base at one sampling seed and temperature
    eval:<label>:t<T>                   one run, sampling seed 0                    needs train:<label>
    diff                                the weight diff of every run                needs every train
    sparsity:<label>                    claim 3's sweep, first seed of es and grpo  needs train:<label>
    entropy:base, entropy:<label>       token entropy (es and grpo runs)            needs train:<label>
    diversity:<label>                   the population around the first es run      needs train:<label>
    heldout:<task>:<label|base>         held-out tasks (forgetting)                 needs train:<label>

Every measurement writes its result to DIR/cache (keyed by the content hash of what it depends on), so
each task is resumable on its own and its result is small (a cache path, or a few lists of numbers).
Every task declares --cpus-per-run / --gpus-per-run (what a Ray executor schedules on; the local
executor ignores them). Measurements other than the Pass@K evaluations run at the verdict temperature
(`StudyConfig.verdict_temperature`).
"""

from __future__ import annotations

from deltalens.study import diversity, measures, sparsity, train
from deltalens.study.config import StudyConfig
from deltalens.study.executor import Task
from deltalens.study.runs import by_group


def t_key(t: float) -> str:
    """A temperature as task keys and analysis.json name it: 0.6 -> "0.6", 1.0 -> "1"."""
    return f"{t:g}"


def study_tasks(cfg: StudyConfig, plan: list[dict]) -> list[Task]:
    """The study's task graph (module docstring), in the order the local executor runs it."""
    res = {"cpus": float(cfg.cpus_per_run), "gpus": float(cfg.gpus_per_run)}
    groups = by_group(plan)
    trained = {r["label"]: f"train:{r['label']}" for r in plan}
    tasks = [Task(trained[r["label"]], train.train_run, (cfg, r["label"]), kind="train",
                  outputs=(f"runs/{r['label']}",), **res) for r in plan]

    def measure(key, fn, *args, label=None, deps=(), kind="eval", **kw):
        need = (trained[label],) if label is not None else ()
        tasks.append(Task(key, fn, (cfg, *args), kw, deps=need + tuple(deps), kind=kind, outputs=("cache",), **res))

    for t in cfg.eval_temperatures:
        for s in range(cfg.base_seeds):
            measure(f"eval:base:s{s}:t{t_key(t)}", measures.eval_task, None, s, t)
        for r in plan:
            measure(f"eval:{r['label']}:t{t_key(t)}", measures.eval_task, r["label"], 0, t, label=r["label"])
    measure("diff", measures.diff_task, deps=tuple(trained.values()), kind="diff")
    for meth in ("es", "grpo"):
        if meth in groups and cfg.first_run_measures:
            r0 = groups[meth][0]
            measure(f"sparsity:{r0['label']}", sparsity.sparsity_task, r0["label"], label=r0["label"],
                    kind="sparsify")
    measure("entropy:base", measures.entropy_task, None, kind="entropy")
    for meth in ("es", "grpo"):
        for r in groups.get(meth, []):
            measure(f"entropy:{r['label']}", measures.entropy_task, r["label"], label=r["label"], kind="entropy")
    if "es" in groups and cfg.first_run_measures:
        r0 = groups["es"][0]
        measure(f"diversity:{r0['label']}", diversity.diversity_task, r0["label"], label=r0["label"],
                kind="diversity")
    for name in cfg.held_out:
        measure(f"heldout:{name}:base", measures.eval_task, None, 0, cfg.verdict_temperature, task=name)
        for r in plan:
            measure(f"heldout:{name}:{r['label']}", measures.eval_task, r["label"], 0, cfg.verdict_temperature,
                    label=r["label"], task=name)
    return tasks
