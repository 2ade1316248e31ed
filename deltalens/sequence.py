"""Sequential methods: ES then GRPO (or any chain of "es"/"grpo") as one run directory.

    out/
      config.json      {"method": "es-grpo", "methods": [...], "model", "task", "budget", "fractions",
                        "stages": [{"method", "dir", "config"}, ...]}
      metrics.jsonl    every stage's rows, in order, each with "stage" (its method), "stage_index",
                       "stage_iteration" (the row's own iteration), "iteration" (counted across stages,
                       so reports plot one axis) and "units" (compute units so far, `deltalens.budget`)
      state.json       {"method", "iteration", "stages_done", "checkpoint": "final"} once finished
      checkpoints/final/   the last stage's final checkpoint (hard links where possible, else a copy),
                           so `load_model(out)` loads the end of the chain
      es/              a complete ES run (deltalens.es)
      grpo/            a complete GRPO run (deltalens.grpo) that starts from es/'s final weights
                       (init_from = out/es; its KL reference is those weights too)

Each stage after the first starts from the previous stage's final checkpoint: GRPO through `init_from`,
ES through its `model`. With `budget`, the stages split it (half/half by default) and each gets the most
iterations/steps that fit its share (`deltalens.budget`). A killed sequence resumes stage by stage:
finished stages are skipped, the interrupted one resumes from its last checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from deltalens.errors import DeltalensError

METHODS = ("es", "grpo")


def stage_dirs(methods: Sequence[str]) -> list[str]:
    """Sub-run directory names: the method names, numbered when a method repeats (1-grpo, 2-grpo)."""
    if len(set(methods)) == len(methods):
        return list(methods)
    return [f"{i + 1}-{m}" for i, m in enumerate(methods)]


def _total(method: str, cfg) -> int:
    return cfg.iterations if method == "es" else cfg.steps


def _units(method: str, cfg, it: int) -> int:
    from deltalens.budget import es_units, grpo_units

    if method == "es":
        return es_units(it, cfg.prompts_per_iteration, cfg.population)
    return grpo_units(it, cfg.prompts_per_step, cfg.num_generations)


def _default_config(method: str, model: str):
    if method == "es":
        from deltalens.es import ESConfig

        return ESConfig.preset("tiny" if model == "tiny" else "paper")
    from deltalens.grpo import GRPORunConfig

    return GRPORunConfig.preset("tiny" if model == "tiny" else "paper")


def stage_configs(out: Path, methods: Sequence[str], model: str, task: str, configs: dict, task_fields: dict,
                  budget=None, fractions: Sequence[float] | None = None) -> list:
    """One config per stage: the given (or preset) config of its method, pointed at the sequence's task
    and at the previous stage's run directory, with iterations/steps from the budget share if any."""
    from deltalens.budget import iterations_for_budget, split_budget, steps_for_budget

    shares = split_budget(budget, fractions or [1 / len(methods)] * len(methods)) if budget is not None else None
    if fractions is not None and len(fractions) != len(methods):
        raise DeltalensError(f"got {len(fractions)} budget fractions for {len(methods)} stages")
    dirs = stage_dirs(methods)
    out_cfgs = []
    for i, method in enumerate(methods):
        if method not in METHODS:
            raise DeltalensError(f"unknown method {method!r} in the sequence; use {' and '.join(METHODS)}")
        cfg = configs.get(method) or _default_config(method, model)
        prev = str((out / dirs[i - 1]).resolve()) if i > 0 else None
        if method == "es":
            cfg = dataclasses.replace(cfg, model=prev or model, task=task, **task_fields)
            if shares:
                cfg = dataclasses.replace(cfg, iterations=iterations_for_budget(
                    shares[i], cfg.prompts_per_iteration, cfg.population))
        else:
            cfg = dataclasses.replace(cfg, model=model, init_from=prev or cfg.init_from, task=task, **task_fields)
            if shares:
                cfg = dataclasses.replace(cfg, steps=steps_for_budget(shares[i], cfg.prompts_per_step,
                                                                       cfg.num_generations))
        out_cfgs.append(cfg)
    return out_cfgs


def _rebuild_metrics(out: Path, methods, dirs, cfgs) -> None:
    """Concatenate the stages' metrics into out/metrics.jsonl (rewritten atomically; idempotent)."""
    import json

    from deltalens.checkpoint import atomic_path
    from deltalens.runs import RunDir

    lines, it_offset, unit_offset = [], 0, 0
    for i, (method, d, cfg) in enumerate(zip(methods, dirs, cfgs)):
        for r in RunDir(out / d).metrics():
            it = r.get("iteration", 0)
            lines.append(json.dumps({**r, "stage": method, "stage_index": i, "stage_iteration": it,
                                     "iteration": it_offset + it, "units": unit_offset + _units(method, cfg, it)}))
        it_offset += _total(method, cfg)
        unit_offset += _units(method, cfg, _total(method, cfg))
    with atomic_path(out / "metrics.jsonl") as tmp:
        Path(tmp).write_text("".join(line + "\n" for line in lines))


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _stage_done(run_dir: Path, total: int) -> bool:
    from deltalens.runs import RunDir

    st = RunDir(run_dir).state()
    return bool(st) and st.get("checkpoint") == "final" and st.get("iteration") == total and \
        (run_dir / "checkpoints" / "final" / "config.json").exists()


def train_sequence(out: str | Path, methods: Sequence[str] = ("es", "grpo"), *, model: str = "tiny",
                   task: str = "arith", data: str | None = None, question_field: str = "question",
                   answer_field: str = "answer", budget=None, fractions: Sequence[float] | None = None,
                   es_config=None, grpo_config=None, resume: bool = False, overwrite: bool = False,
                   progress: Callable[[int, int, dict | None], None] | None = None) -> Path:
    """Train `methods` one after another into `out` (see module docstring); returns `out`.

    es_config / grpo_config: the stages' hyperparameters (ESConfig / GRPORunConfig; None = the preset
    for `model`); their model/task/init_from are set here, and with `budget` (units, or '2e6'/'1.5M')
    their iterations/steps too, split by `fractions` (default equal shares). On `resume` with no configs
    given, the stored stage configs are used. progress(done, total, row) counts iterations/steps over
    all stages; rows carry "stage".
    """
    from deltalens import __version__
    from deltalens.checkpoint import atomic_dir, write_json_atomic
    from deltalens.es import ESConfig, train_es
    from deltalens.grpo import GRPORunConfig, train_grpo
    from deltalens.runs import RunDir

    out = Path(out)
    methods = list(methods)
    if not methods:
        raise DeltalensError("a sequence needs at least one method")
    dirs = stage_dirs(methods)
    run = RunDir(out)
    task_fields = {"data": data, "question_field": question_field, "answer_field": answer_field}
    if resume:
        stored = run.config()
        if stored.get("methods") != methods:
            raise DeltalensError(f"{out} is a sequence of {stored.get('methods')}, not {methods}; resume it with "
                                 "the same --method")
        if es_config is None and grpo_config is None:
            cfgs = [ESConfig.from_dict(s["config"]) if s["method"] == "es" else GRPORunConfig.from_dict(s["config"])
                    for s in stored["stages"]]
        else:
            cfgs = stage_configs(out, methods, stored["model"], stored["task"],
                                 {"es": es_config, "grpo": grpo_config}, task_fields, stored.get("budget"),
                                 stored.get("fractions"))
    else:
        cfgs = stage_configs(out, methods, model, task, {"es": es_config, "grpo": grpo_config}, task_fields,
                             budget, fractions)
    top = {"method": "-".join(methods), "methods": methods, "model": model, "task": task, **task_fields,
           "budget": budget, "fractions": list(fractions) if fractions is not None else None,
           "stages": [{"method": m, "dir": d, "config": c.to_dict()} for m, d, c in zip(methods, dirs, cfgs)],
           "deltalens_version": __version__}
    if resume:
        stored.update({"stages": top["stages"], "deltalens_version": __version__})
        write_json_atomic(stored, out / "config.json")
    else:
        run.create(top, overwrite=overwrite)

    totals = [_total(m, c) for m, c in zip(methods, cfgs)]
    grand = sum(totals)
    for i, (method, d, cfg) in enumerate(zip(methods, dirs, cfgs)):
        sub = out / d
        offset = sum(totals[:i])
        if not _stage_done(sub, totals[i]):
            def stage_progress(done, total, row, _off=offset, _m=method, _i=i):
                if progress:
                    progress(_off + done, grand, None if row is None else {**row, "stage": _m, "stage_index": _i})

            trainer = train_es if method == "es" else train_grpo
            again = resume and (sub / "config.json").exists()
            if again:
                trainer(cfg, sub, resume=True, progress=stage_progress)
            else:
                trainer(cfg, sub, resume=False, progress=stage_progress, overwrite=overwrite or resume)
        _rebuild_metrics(out, methods[: i + 1], dirs[: i + 1], cfgs[: i + 1])

    last = out / dirs[-1] / "checkpoints" / "final"
    with atomic_dir(run.ckpt / "final") as tmp:
        shutil.copytree(last, tmp, copy_function=_link_or_copy, dirs_exist_ok=True)
    write_json_atomic({"method": top["method"], "iteration": grand, "stages_done": len(methods),
                       "final_from": f"{dirs[-1]}/checkpoints/final", "checkpoint": "final"}, out / "state.json")
    return out


# ----------------------------------------------------------------------------------------------
# CLI adapter (cli/train.py METHODS["es-grpo"])

ES_ONLY = {"population": "population", "sigma": "sigma", "alpha": "alpha", "antithetic": "antithetic",
           "fitness": "fitness", "params": "params", "restore": "restore", "backend": "backend",
           "workers": "workers", "iterations": "iterations"}
SHARED = {"max_new_tokens": "max_new_tokens", "dtype": "dtype", "eval_every": "eval_every",
          "eval_limit": "eval_limit", "seed": "seed", "save_pt": "save_pt"}


def train_cli(opts: dict, progress) -> Path:
    """`deltalens train --method es-grpo`: ES options (--population, --sigma, --alpha, --iterations, ...)
    go to the ES stage, GRPO options (--steps, --lr, --num-generations, --beta, ...) to the GRPO stage,
    shared ones (--prompts, --max-new-tokens, --dtype, --seed, --eval-every, --checkpoint-every, ...) to
    both; --budget B splits B units between them (--es-fraction, default 0.5)."""
    from deltalens.es import ESConfig
    from deltalens.grpo import GRPO_ONLY_CLI, GRPORunConfig, auto_preset

    if opts.get("temperature") is not None:
        raise DeltalensError("--temperature is ambiguous for es-grpo (ES decodes greedily, GRPO samples at 1.0); "
                             "set the stages' temperatures in Python (deltalens.sequence.train_sequence)")
    out = opts["out"]
    if opts.get("resume") is not None:
        from deltalens.runs import RunDir

        stored = RunDir(out).config()
        return train_sequence(out, stored["methods"], resume=True, progress=progress)
    model = opts.get("model") or "tiny"
    preset = auto_preset(opts.get("preset"), model)
    es = {f: opts[o] for f, o in {**ES_ONLY, **SHARED}.items() if opts.get(o) is not None}
    if opts.get("prompts") is not None:
        es["prompts_per_iteration"] = opts["prompts"]
    if opts.get("checkpoint_every") is not None:
        es["checkpoint_every"] = opts["checkpoint_every"]
    gr = {f: opts[o] for f, o in {**GRPO_ONLY_CLI, **SHARED}.items() if opts.get(o) is not None}
    if opts.get("prompts") is not None:
        gr["prompts_per_step"] = opts["prompts"]
    if opts.get("checkpoint_every") is not None:
        gr["save_every"] = opts["checkpoint_every"]
    if opts.get("steps") is not None:
        gr["steps"] = opts["steps"]
    budget = opts.get("budget")
    if budget is not None and ("iterations" in es or "steps" in gr):
        raise DeltalensError("pass either --budget or --iterations/--steps, not both")
    frac = opts.get("es_fraction")
    fractions = None
    if frac is not None:
        if not 0 < frac < 1:
            raise DeltalensError(f"--es-fraction must be in (0, 1) (got {frac})")
        fractions = [frac, 1 - frac] if opts.get("method", "es-grpo").startswith("es") else [1 - frac, frac]
    es_cfg = ESConfig.preset(preset if preset in ("tiny", "paper") else "paper", **es)
    gr_cfg = GRPORunConfig.preset(preset if preset in ("tiny", "paper") else "paper", **gr)
    methods = (opts.get("method") or "es-grpo").split("-")
    return train_sequence(out, methods, model=model, task=opts.get("task") or "arith", data=opts.get("data"),
                          question_field=opts.get("question_field") or "question",
                          answer_field=opts.get("answer_field") or "answer", budget=budget, fractions=fractions,
                          es_config=es_cfg, grpo_config=gr_cfg, overwrite=bool(opts.get("overwrite")),
                          progress=progress)
