"""Entry points of `deltalens train`: a config from (preset, YAML, command line), then the trainer.

    start("es", given={"sigma": 3e-3}, yaml_path="run.yaml", out="runs/es")   # deltalens train es ...
    start("es", given={"iterations": 200}, resume="runs/es")                 # continue with new settings
    resume_run("runs/x", given={"iterations": 200})                          # deltalens train resume DIR

A method's config class and trainer come from the registry (`deltalens.training.methods`): `start`
takes every registered method (es, grpo, ...) and `chain`; a resume reads the method from the run.

Precedence, lowest first: the dataclass defaults, the preset (`auto`: the model's own preset where it
has one, else the paper's; `deltalens.presets`), the YAML file, the options given on the command line.
Without a task anywhere, the model's default task is used (`deltalens.presets.default_task`). A resume starts from
the run's stored config instead of a preset; options that decide the trajectory may not change
(`deltalens.training.run.check_resume`). Everything is validated before the run directory is touched,
the output directory first (`deltalens.io.outputs`: it may not hold or lie inside an input).

A run's own config.json is a valid `--config` (`deltalens.config.is_run_config`):

    start("es", yaml_path="runs/es/config.json", out="runs/es-again")     # the same run, bit-identical

Its options are the stored base of the new run, as on a resume (`Config.run_options`; a chain's:
`ChainConfig.run_options`), with the command line above them; no preset applies (`--preset` is refused),
nor the model's default task. Another method's run config is refused with one line naming the command
that takes it; `--resume` with a run's config.json is refused too (a resume reads its own).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from deltalens.config import Config, brief, is_run_config, load_yaml
from deltalens.errors import DeltalensError
from deltalens.io.outputs import Output, check_outputs
from deltalens.io.runs import RunDir
from deltalens.methods import chain_stages, chains, is_run_method
from deltalens.presets import auto_preset, default_task
from deltalens.training import methods
from deltalens.training.chain import ChainConfig, train_chain, train_chain_config

Progress = Callable[[int, int, "dict | None"], None]


def commands() -> tuple[str, ...]:
    """What `start` takes: every registered method, then chain."""
    return (*methods.REGISTRY, "chain")


def config_class(method: str) -> type[Config]:
    """The config class of `deltalens train METHOD` (a registered method, or chain)."""
    if method == "chain":
        return ChainConfig
    if methods.find(method) is None:
        raise DeltalensError(f"unknown method {method!r}; use one of {', '.join(commands())}")
    return methods.get(method).config


def _yaml(path: str | Path | None, method: str) -> tuple[dict, str | None, bool]:
    """(the YAML mapping with its record fields removed, the preset it names, whether it is a run's
    config.json); a mapping for another method is refused."""
    if path is None:
        return {}, None, False
    data = load_yaml(path)
    run = is_run_config(data)
    named = data.pop("method", None)
    data.pop("deltalens_version", None)
    chain_run = run and "stages" in data
    target = "chain" if chain_stages(named) is not None or chain_run else named
    if target is not None and target != method:
        if not isinstance(target, str) or target not in commands():  # any YAML value: never echo it whole
            raise DeltalensError(f"{path}: method must be one of {', '.join((*commands(), *chains()))} "
                                 f"(got {brief(named)})")
        what = "a run's config.json for method" if run else "a"
        what = f"{what} {brief(named, 40)}" + ("" if run else " config")
        raise DeltalensError(f"{path} is {what}; use `deltalens train {target}` for it")
    if run:
        return data, None, True
    return data, data.pop("preset", None), False


def make_config(method: str, *, given: dict | None = None, yaml_path: str | Path | None = None,
                preset: str | None = None) -> tuple[Config, str]:
    """The config of a new `method` run and the preset used. `given`: command-line options actually passed.
    A run's config.json as `yaml_path` gives that run's config (module docstring)."""
    cls = config_class(method)
    given = dict(given or {})
    yaml, yaml_preset, run = _yaml(yaml_path, method)
    source = str(yaml_path) if yaml_path is not None else "the config file"
    if run:
        if preset is not None:
            raise DeltalensError(f"--preset does not apply to {yaml_path}: a run's config.json holds every setting "
                                 "of its run; drop --preset")
        if cls is ChainConfig:
            options = ChainConfig.run_options(yaml, source, budget_given=given.get("budget") is not None)
            return ChainConfig.resolve(yaml=options, given=given, source=source), "paper"
        return cls.resolve(stored=cls.run_options(yaml, source), given=given, source=source), "paper"
    model = given.get("model") or yaml.get("model") or cls.field("model").default
    preset = preset or yaml_preset or "auto"
    if preset == "auto":
        preset = auto_preset(model)
    if "task" not in given and "task" not in yaml:
        given["task"] = default_task(model)
    if cls is ChainConfig:
        return ChainConfig.resolve(yaml=yaml, given=given, source=source), preset
    return cls.resolve(preset=preset, yaml=yaml, given=given, source=source), preset


def start(method: str, *, out: str | Path | None = None, resume: str | Path | None = None,
          given: dict | None = None, yaml_path: str | Path | None = None, preset: str | None = None,
          overwrite: bool = False, progress: Progress | None = None) -> Path:
    """`deltalens train es|grpo|chain`: a new run into `out`, or with `resume` a continued one."""
    if resume is not None:
        if out is not None and Path(out).resolve() != Path(resume).resolve():
            raise DeltalensError(f"--out {out} and --resume {resume} differ; pass only --resume {resume}")
        if preset is not None:
            raise DeltalensError("--preset is for new runs; a resumed run keeps its own settings")
        stored, is_chain = _run_method(Path(resume))
        if stored != method and not (method == "chain" and is_chain):
            raise DeltalensError(f"{resume} is a {stored} run; continue it with `deltalens train resume {resume}`")
        yaml, _, run = _yaml(yaml_path, method)
        if run:
            raise DeltalensError(f"{yaml_path} is a run's config.json: --resume continues {resume} with its own; "
                                 "drop --config (or start a new run from it with --out)")
        return resume_run(resume, given={**yaml, **(given or {})}, progress=progress)
    if out is None:
        raise DeltalensError("pass --out DIR for a new run (or --resume DIR to continue one)")
    config, preset = make_config(method, given=given, yaml_path=yaml_path, preset=preset)
    check_outputs([Output(Path(out), "--out", directory=True)],
                  models=[config.model, getattr(config, "init_from", None)], files=[config.data, yaml_path])
    if isinstance(config, ChainConfig):
        _check_chain_start(config, preset)
        return train_chain_config(config, out, preset=preset, overwrite=overwrite, progress=progress)
    return methods.get(method).train(config, out, resume=False, progress=progress, overwrite=overwrite)


def check_start(model: str, chat_templates) -> None:
    """Refuse now what training would refuse only once its directory exists: a missing, corrupt or
    incomplete model (`load_model`), and a chat-template setting the tokenizer cannot honour (`uses_chat`),
    so a refused chain, sweep or study leaves nothing that blocks its retry. Costs one extra load of the
    model, whose weights are dropped again."""
    from deltalens.generation.prompts import uses_chat
    from deltalens.io.models import load_model

    _, tok = load_model(model)
    for mode in chat_templates:
        uses_chat(tok, mode)


def _check_chain_start(config: ChainConfig, preset: str) -> None:
    """`check_start` for a chain: its base model and every stage's chat-template setting."""
    check_start(config.model, [stage.chat_template for stage in config.stage_presets(preset).values()])


def train_unless_finished(run_dir: str | Path, total: int, label: str, train: Callable[..., object], *,
                          log: Callable[[str], None], progress_factory=None,
                          check_finished: Callable[[], None] | None = None) -> None:
    """Bring a run directory to `total` iterations/steps: nothing when it is finished (after
    `check_finished()`, which refuses a run trained with other settings), a resume when it was started
    (config.json exists), else a new run. `train(resume=..., progress=...)` trains it; the
    progress bar comes from progress_factory(description, None) (studies and sweeps share this), sized by
    the training's first call, which says where a resumed run starts (so its time left is this run's pace)."""
    run_dir = Path(run_dir)
    if RunDir(run_dir).finished(total):
        if check_finished is not None:
            check_finished()
        log(f"{label}: done")
        return
    again = (run_dir / "config.json").exists()
    log(f"{label}: {'resuming' if again else 'training'} ({total} iterations/steps)")
    bar = progress_factory(f"train {label}", None) if progress_factory else None
    train(resume=again, progress=(lambda done, total, row=None: bar(done, total)) if bar else None)


def _run_method(run_dir: Path) -> tuple[str, bool]:
    """(the method a run's config.json names, whether the run is a chain)."""
    run = RunDir(run_dir)
    if not (run.path / "config.json").is_file():
        raise DeltalensError(f"nothing to resume in {run.path} (no config.json); start a run with --out")
    config = run.config()  # a corrupt config.json is a one-line error naming it
    method = config.get("method")
    if not is_run_method(method):
        raise DeltalensError(f"{run.path}/config.json names no deltalens training method; is it a run directory?")
    # a one-stage chain says "es" like an ES run; its stages tell them apart
    return method, chain_stages(method) is not None or isinstance(config.get("stages"), list)


def resume_run(run_dir: str | Path, *, given: dict | None = None, progress: Progress | None = None) -> Path:
    """`deltalens train resume DIR`: continue the run with its own method and settings; `given` may change
    the settings that do not decide the trajectory (e.g. `iterations`/`steps` to grow it)."""
    run_dir = Path(run_dir)
    method, is_chain = _run_method(run_dir)
    given = dict(given or {})
    if is_chain:
        if given:
            raise DeltalensError(f"a chain resumes with its stored settings; drop {', '.join(sorted(given))}")
        return train_chain(run_dir, RunDir(run_dir).config()["methods"], resume=True, progress=progress)
    m = methods.get(method)
    stored = m.config.from_dict(RunDir(run_dir).config(), source=str(run_dir / "config.json"))
    config = m.config.resolve(stored={k: v for k, v in stored.to_dict().items() if k != "method"}, given=given)
    return m.train(config, run_dir, resume=True, progress=progress)
