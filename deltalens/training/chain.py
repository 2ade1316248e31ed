"""Chains: ES then GRPO (or GRPO then ES, or any sequence of stage methods) as one run directory.

    out/
      config.json      {"method": "es-grpo", "methods": [...], "model", "task", "budget", "fractions",
                        "stages": [{"method", "dir", "config"}, ...]}
      metrics.jsonl    every stage's rows, in order, each with "stage" (its method), "stage_index",
                       "stage_iteration" (the row's own iteration), "iteration" (counted across stages,
                       so reports plot one axis) and "units" (compute units so far, `deltalens.training.budget`)
      state.json       {"method", "iteration", "stages_done", "checkpoint": "final"} once finished
      checkpoints/final/   the last stage's final checkpoint (hard links where possible, else a copy),
                           so `load_model(out)` loads the end of the chain
      es/              a complete ES run (deltalens.training.es)
      grpo/            a complete GRPO run (deltalens.training.grpo) that starts from es/'s final weights
                       (init_from = out/es; its KL reference is those weights too)

`method`, `deltalens_version` and `stages` are the chain's record fields; the rest are ChainConfig options,
and each stage's `config` is that stage run's own config.json content (`deltalens.config`: options in use).
The file is a valid `deltalens train chain --config` that reproduces the chain (`ChainConfig.run_options`):
the chain's options, and per method the options of its stages less those the chain sets itself, and less
the iterations/steps when the chain has a budget (derived from it, and derived again the same way).

The stage methods are the registry's (`deltalens.training.methods`, names in `deltalens.methods.stage_names`:
es, grpo, and any method registered later as a stage); each stage's config class, trainer and budget unit
come from there. Each stage after the first starts from the previous stage's final checkpoint: GRPO through
`init_from`, ES through its `model` (`Method.start_from`). With `budget`, the stages split it (equal shares
by default, `fractions`) and each gets the most iterations/steps that fit its share. A killed chain resumes
stage by stage: finished stages are skipped, the interrupted one resumes from its last checkpoint. A stage
names the stage before it by absolute path; a chain moved or copied before it finished resumes from its own
earlier stages (`_follow_move`), never from the directory it was copied from.

`ChainConfig` is what `deltalens train chain` and YAML files give: the chain's own fields plus each stage
method's options under its name (`es:`, `grpo:`: option name -> value, checked against that method's config;
on the command line `--es-sigma`, `--grpo-learning-rate`, ...; in Python `stage_options={"es": {...}}`). The
stage fields a chain sets itself (model, task, data, init_from, and the counts when a budget is given)
cannot be given per stage.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from deltalens import __version__
from deltalens.config import NOT_NONE, Config, brief, check, option
from deltalens.errors import DeltalensError
from deltalens.io.atomic import atomic_dir, atomic_path, write_json_atomic
from deltalens.io.runs import RunDir
from deltalens.io.spec import resolve
from deltalens.methods import chain_name, stage_names
from deltalens.presets import auto_preset
from deltalens.tasks import get_task
from deltalens.training.budget import parse_budget, split_budget
from deltalens.training.methods import get as get_method
from deltalens.training.run import check_finished
from deltalens.training.tracking import HELP as REPORT_TO_HELP
from deltalens.training.tracking import normalize_report_to, require

TASK_FIELDS = ("data", "question_field", "answer_field")
# stage fields the chain sets itself: never per stage
CHAIN_OWNED = ("model", "task", *TASK_FIELDS, "init_from", "budget", "report_to")


@dataclass
class ChainConfig(Config):
    """A chain of stages, each a registered stage method (see module docstring)."""

    METHOD: ClassVar[str] = "chain"
    NAME: ClassVar[str] = "chain"

    methods: tuple[str, ...] = option(("es", "grpo"), "stages in order, comma-separated: es,grpo (ES->GRPO), "
                                      "grpo,es, or any sequence of stage methods")
    model: str = option("tiny", "base model spec of the first stage (tiny, smollm2, HF dir, run dir, .gguf)")
    task: str = option("arith", "task name (deltalens.tasks), for every stage", flags=("-t",))
    data: str | None = option(None, "jsonl file or directory for the gsm8k and jsonl tasks")
    question_field: str = option("question", "jsonl task: question field")
    answer_field: str = option("answer", "jsonl task: answer field")
    budget: float | str | None = option(None, "FLOP-matched compute units for the whole chain, split between the "
                                        "stages (deltalens.training.budget)")
    fractions: tuple[float, ...] | None = option(None, "budget share of each stage, comma-separated (default: "
                                                 "equal shares)", needs=("budget", NOT_NONE))
    stage_options: dict = option(None, "each stage method's options: method -> {option: value} (YAML: a mapping "
                                 "under the method's name, es: {sigma: ...}; --es-<field> on the command line)",
                                 default_factory=dict, cli=False)
    report_to: str = option("none", REPORT_TO_HELP + "; every stage logs in its own run directory")

    def __post_init__(self):
        self.methods = tuple(self.methods)
        stages = stage_names()
        check([
            (len(self.methods) >= 1, "a chain needs at least one method; set --methods es,grpo"),
            (all(m in stages for m in self.methods),
             f"unknown method in --methods {','.join(map(str, self.methods))}; use {', '.join(stages)}"),
            (self.fractions is None or len(self.fractions) == len(self.methods),
             f"got {len(self.fractions or ())} budget fractions for {len(self.methods)} stages"),
            (isinstance(self.stage_options, dict) and all(m in stages for m in self.stage_options),
             f"stage options are a mapping of stage methods ({', '.join(stages)}) to their options"),
        ])
        if self.budget is not None:
            self.budget = parse_budget(self.budget)
        self.report_to = normalize_report_to(self.report_to)
        checked = {}
        for method, opts in self.stage_options.items():
            cls = get_method(method).config
            if not isinstance(opts, dict):
                raise DeltalensError(f"{method} stage options must be a mapping of option names to values")
            opts = cls.check_keys(opts, f"{method} stage options")
            if opts:
                checked[method] = opts
            owned = sorted(set(opts) & set(CHAIN_OWNED))
            if owned:
                raise DeltalensError(f"the chain sets {', '.join(owned)} of its {method} stage itself; give "
                                     f"{', '.join('--' + o.replace('_', '-') for o in owned)} for the whole chain")
            count = cls.COUNT
            if self.budget is not None and opts.get(count) is not None:
                raise DeltalensError(f"pass either --budget or --{method}-{count}, not both")
            if opts and method not in self.methods:
                raise DeltalensError(f"{method} stage options given but --methods {','.join(self.methods)} has no "
                                     f"{method} stage")
        self.stage_options = checked

    def to_dict(self, in_use: bool = False) -> dict:
        """As Config.to_dict, with each stage method's options under its name (es: {...}), as YAML gives them."""
        out = super().to_dict(in_use)
        return {**{k: v for k, v in out.items() if k != "stage_options"}, **self.stage_options}

    @classmethod
    def resolve(cls, *, preset=None, yaml=None, given=None, stored=None, source="the config file") -> ChainConfig:
        """As Config.resolve, with the stage option mappings (under each stage method's name) merged key by key
        (command line wins)."""
        yaml, given = dict(yaml or {}), dict(given or {})
        if "stage_options" in yaml or "stage_options" in given:
            raise DeltalensError(f"{source}: give each stage's options under its method's name "
                                 f"({', '.join(f'{m}:' for m in stage_names())}), not stage_options")
        for m in stage_names():  # before merging: `{**[1]}` would be a TypeError
            if not isinstance(yaml.get(m) or {}, dict):
                raise DeltalensError(f"{source}: {m} must be a mapping of {m} options")
        stages = {m: {**(yaml.pop(m, None) or {}), **(given.pop(m, None) or {})} for m in stage_names()}
        cfg = super().resolve(preset=None, yaml=yaml, given=given, stored=stored, source=source)
        return dataclasses.replace(cfg, stage_options={m: opts for m, opts in stages.items() if opts})

    @classmethod
    def run_options(cls, d: dict, source: str = "config", *, budget_given: bool = False) -> dict:
        """A chain run's config.json as ChainConfig options (a mapping for `resolve(yaml=...)`), with each
        stage method's name holding the options of its stages (see module docstring); start the chain on
        the `paper` preset, so nothing but these options decides it. `budget_given`: the command line gives a
        new budget, which replaces the stored counts as well."""
        if not isinstance(d, dict):
            raise DeltalensError(f"{source} must be a mapping of option names to values")
        stages = d.get("stages")
        if not isinstance(stages, list) or not all(isinstance(st, dict) and isinstance(st.get("config"), dict)
                                                   for st in stages):
            raise DeltalensError(f"{source}: stages must be a list of {{method, dir, config}} mappings (as a "
                                 "chain run writes them)")
        stage_keys = sorted(set(d) & set(stage_names()))
        if stage_keys:
            raise DeltalensError(f"{source}: a chain run's config.json holds its stage options in `stages`, not in "
                                 f"{' or '.join(stage_keys)}")
        top = {k: v for k, v in d.items() if k not in ("method", "deltalens_version", "stages")}
        names = {f.name for f in dataclasses.fields(cls)}
        for key in CHAIN_OWNED:  # a chain option recorded only in its stages (the first stage's value)
            if key in names and key not in top and stages and key in stages[0]["config"]:
                top[key] = stages[0]["config"][key]
        out = super().run_options(top, source)
        methods = list(out.get("methods", cls.field("methods").default))
        method = d.get("method", chain_name(methods))
        if [st.get("method") for st in stages] != methods or method != chain_name(methods):
            raise DeltalensError(f"{source}: its method, methods and stages disagree; restore it from the run")
        count_derived = budget_given or out.get("budget") is not None
        for m in stage_names():
            cls_m = get_method(m).config
            seen = []
            for st in stages:
                if st["method"] != m:
                    continue
                where = f"{source}, stage {brief(st.get('dir'), 40)}"
                opts = cls_m.run_options(st["config"], where)
                drop = set(CHAIN_OWNED) | ({cls_m.COUNT} if count_derived else set())
                seen.append({k: v for k, v in opts.items() if k not in drop})
            if any(x != seen[0] for x in seen[1:]):
                raise DeltalensError(f"{source}: its {m} stages hold different options; a chain gives every {m} "
                                     "stage the same ones")
            if seen:
                out[m] = seen[0]
        return out

    def stage_presets(self, preset: str) -> dict:
        """method -> the stage's config: the preset plus the stage options (the chain then points it at
        its model, task and previous stage, and sets its count from the budget: `stage_configs`)."""
        return {m: get_method(m).config.resolve(preset=preset, given={**self.stage_options.get(m, {}),
                                                                      "report_to": self.report_to})
                for m in dict.fromkeys(self.methods)}


def stage_dirs(methods: Sequence[str]) -> list[str]:
    """Sub-run directory names: the method names, numbered when a method repeats (1-grpo, 2-grpo)."""
    if len(set(methods)) == len(methods):
        return list(methods)
    return [f"{i + 1}-{m}" for i, m in enumerate(methods)]


def _default_config(method: str, model: str):
    return get_method(method).config.preset(auto_preset(model))


def stage_configs(out: Path, methods: Sequence[str], model: str, task: str, configs: dict, task_fields: dict,
                  budget=None, fractions: Sequence[float] | None = None) -> list:
    """One config per stage: the given (or preset) config of its method, pointed at the chain's task
    and at the previous stage's run directory, with iterations/steps from the budget share if any."""
    shares = split_budget(budget, fractions or [1 / len(methods)] * len(methods)) if budget is not None else None
    if fractions is not None and len(fractions) != len(methods):
        raise DeltalensError(f"got {len(fractions)} budget fractions for {len(methods)} stages")
    dirs = stage_dirs(methods)
    out_cfgs = []
    for i, method in enumerate(methods):
        if method not in stage_names():
            raise DeltalensError(f"unknown method {method!r} in the chain; use {', '.join(stage_names())}")
        m = get_method(method)
        cfg = configs.get(method) or _default_config(method, model)
        point = {"model": model, "task": task, **task_fields}
        if "budget" in {f.name for f in dataclasses.fields(cfg)}:  # the chain's budget decides the count
            point["budget"] = None
        if i > 0:  # ES starts from the previous stage's weights as its model, GRPO through init_from
            point[m.start_from] = str((out / dirs[i - 1]).resolve())
        cfg = dataclasses.replace(cfg, **point)
        if shares:
            cfg = dataclasses.replace(cfg, **{m.count: m.count_for_budget(cfg, shares[i])})
        out_cfgs.append(cfg)
    return out_cfgs


def check_finished_chain(out: Path, methods: Sequence[str], model: str, task: str, configs: dict, budget=None,
                         fractions: Sequence[float] | None = None, task_fields: dict | None = None) -> None:
    """`training.run.check_finished` for every stage of a finished chain that a study reuses: each stage's
    config.json against the stage config `stage_configs` plans, its path to the stage before not compared
    (absolute: it moves with the study directory)."""
    cfgs = stage_configs(Path(out), methods, model, task, configs,
                         task_fields or {"data": None, "question_field": "question", "answer_field": "answer"},
                         budget, fractions)
    for i, (method, d, cfg) in enumerate(zip(methods, stage_dirs(methods), cfgs)):
        check_finished(Path(out) / d, cfg, skip=(get_method(method).start_from,) if i else ())


def _rebuild_metrics(out: Path, stages, dirs, cfgs) -> None:
    """Concatenate the stages' metrics into out/metrics.jsonl (rewritten atomically; idempotent)."""
    lines, it_offset, unit_offset = [], 0, 0
    for i, (method, d, cfg) in enumerate(zip(stages, dirs, cfgs)):
        m = get_method(method)
        for r in RunDir(out / d).metrics():
            it = r.get("iteration", 0)
            lines.append(json.dumps({**r, "stage": method, "stage_index": i, "stage_iteration": it,
                                     "iteration": it_offset + it, "units": unit_offset + m.units(cfg, it)}))
        it_offset += m.total(cfg)
        unit_offset += m.units(cfg, m.total(cfg))
    with atomic_path(out / "metrics.jsonl") as tmp:
        Path(tmp).write_text("".join(line + "\n" for line in lines))


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _stage_config(d: dict):
    return get_method(d["method"]).config.from_dict(d["config"], source=f"stage {d['dir']} of the chain's config.json")


def train_chain(out: str | Path, methods: Sequence[str] = ("es", "grpo"), *, model: str = "tiny",
                task: str = "arith", data: str | None = None, question_field: str = "question",
                answer_field: str = "answer", budget=None, fractions: Sequence[float] | None = None,
                configs: dict | None = None, es_config=None, grpo_config=None, resume: bool = False,
                overwrite: bool = False, progress: Callable[[int, int, dict | None], None] | None = None) -> Path:
    """Train `methods` one after another into `out` (see module docstring); returns `out`.

    configs: method -> its stages' hyperparameters (that method's config; a method missing = the preset
    for `model`); es_config / grpo_config: the same for es and grpo. Their model/task/init_from are set
    here, and with `budget` (units, or '2e6'/'1.5M') their iterations/steps too, split by `fractions`
    (default equal shares). On `resume` with no configs given, the stored stage configs are used.
    progress(done, total, row) counts iterations/steps over all stages; rows carry "stage".
    """
    out = Path(out)
    methods = list(methods)
    if not methods:
        raise DeltalensError("a chain needs at least one method")
    configs = {**(configs or {}), **{m: c for m, c in (("es", es_config), ("grpo", grpo_config)) if c is not None}}
    run = RunDir(out)
    cfgs = None
    if not resume:  # refused before the run directory is created: a bad task, data, model or budget leaves none
        run.check_create(overwrite)
        for c in configs.values():
            require(c.report_to)  # a missing tracker package: before any work
        get_task(task, data=data, question_field=question_field, answer_field=answer_field).test()
        resolve(model)
        cfgs = stage_configs(out, methods, model, task, configs,
                             {"data": data, "question_field": question_field, "answer_field": answer_field}, budget,
                             fractions)
    with run.writing():  # one writer at a time (each stage also locks its own directory)
        return _train_chain(run, methods, model=model, task=task, data=data, question_field=question_field,
                            answer_field=answer_field, budget=budget, fractions=fractions, configs=configs,
                            resume=resume, overwrite=overwrite, progress=progress, cfgs=cfgs)


def _follow_move(sub: Path, key: str, here: str, before: str) -> None:
    """Point an interrupted stage's config.json at the stage `before` it in this chain directory (`here`, an
    absolute path) when it names a directory of that name elsewhere: the chain was moved or copied since
    the stage started. Its resume then loads (and, for GRPO, takes its KL reference from) this chain's own
    earlier stage; the path is a field the chain owns (CHAIN_OWNED), so no setting of the user's changes."""
    run = RunDir(sub)
    doc = run.config()  # one-line errors for a missing, corrupt or non-object config.json
    old = doc.get(key)
    if isinstance(old, str) and old != here and Path(old).name == before:
        run.write_config({**doc, key: here})


def _train_chain(run: RunDir, methods: list[str], *, model, task, data, question_field, answer_field, budget,
                 fractions, configs, resume, overwrite, progress, cfgs) -> Path:
    """train_chain under the chain's writer lock; `cfgs`: a new chain's stage configs (None on resume)."""
    out = run.path
    dirs = stage_dirs(methods)
    task_fields = {"data": data, "question_field": question_field, "answer_field": answer_field}
    if resume:
        stored = run.config()
        if stored.get("methods") != methods:
            raise DeltalensError(f"{out} is a chain of {stored.get('methods')}, not {methods}; resume it with "
                                 "`deltalens train resume`")
        if not configs:
            cfgs = [_stage_config(s) for s in stored["stages"]]
            # each stage starts from the stage before it in this directory (the chain may have moved)
            cfgs = [c if i == 0 else
                    dataclasses.replace(c, **{get_method(m).start_from: str((out / dirs[i - 1]).resolve())})
                    for i, (m, c) in enumerate(zip(methods, cfgs))]
        else:
            cfgs = stage_configs(out, methods, stored["model"], stored["task"], configs, task_fields,
                                 stored.get("budget"), stored.get("fractions"))
    top = {"method": chain_name(methods), "methods": methods, "model": model, "task": task, **task_fields,
           "budget": budget, **({"fractions": list(fractions) if fractions is not None else None}
                                if budget is not None else {}),  # options in use only (deltalens.config)
           "stages": [{"method": m, "dir": d, "config": c.to_dict(in_use=True)}
                      for m, d, c in zip(methods, dirs, cfgs)],
           "deltalens_version": __version__}
    if resume:
        stored.update({"stages": top["stages"], "deltalens_version": __version__})
        write_json_atomic(stored, out / "config.json")
    else:
        run.create(top, overwrite=overwrite)

    totals = [get_method(m).total(c) for m, c in zip(methods, cfgs)]
    grand = sum(totals)
    for i, (method, d, cfg) in enumerate(zip(methods, dirs, cfgs)):
        sub = out / d
        offset = sum(totals[:i])
        if not RunDir(sub).finished(totals[i]):
            def stage_progress(done, total, row, _off=offset, _m=method, _i=i):
                if progress:
                    progress(_off + done, grand, None if row is None else {**row, "stage": _m, "stage_index": _i})

            trainer = get_method(method).train
            again = resume and (sub / "config.json").exists()
            if again and i > 0:  # cfg names this directory's stage before it (stored or planned configs)
                key = get_method(method).start_from
                _follow_move(sub, key, getattr(cfg, key), dirs[i - 1])
            if again:
                trainer(cfg, sub, resume=True, progress=stage_progress)
            else:
                trainer(cfg, sub, resume=False, progress=stage_progress, overwrite=overwrite or resume)
        _rebuild_metrics(out, methods[: i + 1], dirs[: i + 1], cfgs[: i + 1])

    last = out / dirs[-1] / "checkpoints" / "final"
    with atomic_dir(run.ckpt / "final") as tmp:
        shutil.copytree(last, tmp, copy_function=_link_or_copy, dirs_exist_ok=True)
    run.write_state({"method": top["method"], "iteration": grand, "stages_done": len(methods),
                     "final_from": f"{dirs[-1]}/checkpoints/final", "checkpoint": "final"})
    return out


def train_chain_config(config: ChainConfig, out: str | Path, *, preset: str, overwrite: bool = False,
                       progress=None) -> Path:
    """Start the chain a `ChainConfig` describes (stage presets: `preset`)."""
    return train_chain(out, config.methods, model=config.model, task=config.task, data=config.data,
                       question_field=config.question_field, answer_field=config.answer_field,
                       budget=config.budget, fractions=config.fractions, configs=config.stage_presets(preset),
                       overwrite=overwrite, progress=progress)
