"""The registry of training methods: name -> config class, train function, budget unit. `deltalens train`,
chains, sweeps, studies and `eval --trained-on` look a method up here instead of branching on its name.

    m = get("es")
    m.config                       ESConfig (m.count: "iterations"; GRPO: "steps")
    m.train(cfg, out, resume=False, progress=None, overwrite=False)      -> out
    m.total(cfg)                   the iterations/steps the run trains for
    m.units(cfg, n)                compute units of its first n iterations/steps (deltalens.training.budget)
    m.count_for_budget(cfg, b)     the most iterations/steps that fit in b units (at least 1, else refused)
    m.problems(task, cfg, n)       the training problems of its first n iterations/steps, in order
    m.start_from                   the field a chain points at the previous stage's run: ES its `model`,
                                   GRPO `init_from` (its KL reference is then that run too)
    m.stage                        a chain may hold it (True unless registered otherwise)

A new method is one file: a Config subclass (METHOD = its name, COUNT = the field its runs count, the
fields model, task, data, question_field, answer_field, seed, chat_template, report_to, a `tiny` and a
`paper` preset) and a trainer that writes a run directory (`deltalens.io.runs`, `deltalens.training.run`),
then `register(Method(...))`. Its name is then known to the torch-free names (`deltalens.methods`), so
analysis documents recognise its runs; `deltalens train` and `sweep` build their subcommands from the
methods registered when the CLI loads (and `train chain` its `--NAME-<field>` stage options). A chain
(`deltalens.training.chain`) may hold it as a stage: it points the stage at its model, task and data
(STAGE_FIELDS), its tracker, and the previous stage's run (`start_from`); `stage=False` keeps it out.

The trainers are imported when a run trains, not here: the configs load without the trainers, so the CLI
builds its options from this registry cheaply (as `deltalens.training.es` promises).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deltalens import methods as names
from deltalens.config import Config
from deltalens.errors import DeltalensError
from deltalens.training.budget import es_units, grpo_units, iterations_for_budget, steps_for_budget
from deltalens.training.es.config import ESConfig
from deltalens.training.grpo.config import GRPOConfig


@dataclass(frozen=True)
class Method:
    """A training method (see module docstring)."""

    name: str  # the CLI subcommand, and what the run's config.json says in "method"
    config: type[Config]  # its options; COUNT names the field a run counts (iterations, steps)
    train: Callable[..., Path]  # train(config, out, resume=False, progress=None, *, overwrite=False) -> out
    units: Callable[[Config, int], int]  # (config, n) -> compute units of n iterations/steps
    count_for_budget: Callable[[Config, float], int]  # (config, units) -> the most iterations/steps that fit
    problems: Callable[..., list]  # (task, config, n) -> the problems of the first n iterations/steps
    start_from: str = "model"  # the field a chain stage after the first points at the previous stage's run
    summary: str = ""  # one line for `deltalens train NAME --help`
    stage: bool = True  # a chain may hold it (its config then has STAGE_FIELDS)

    @property
    def count(self) -> str:
        return self.config.COUNT

    def total(self, config: Config) -> int:
        """The iterations/steps `config`'s run trains for."""
        return getattr(config, self.count)


REGISTRY: dict[str, Method] = {}
# the fields a chain sets on each of its stages (besides `start_from`): a stage method's config has them
STAGE_FIELDS = ("model", "task", "data", "question_field", "answer_field", "report_to")


def register(method: Method) -> Method:
    """Add `method` (its name also to `deltalens.methods`); refused when the name is taken or the config
    does not match it."""
    cfg = method.config
    if method.name in REGISTRY:
        raise DeltalensError(f"a method named {method.name!r} is already registered")
    if cfg.METHOD != method.name or not cfg.COUNT or method.start_from not in cfg.types():
        raise DeltalensError(f"method {method.name!r}: its config must have METHOD = {method.name!r}, a COUNT "
                             f"field and a {method.start_from!r} field")
    missing = [f for f in STAGE_FIELDS if f not in cfg.types()] if method.stage else []
    if missing:
        raise DeltalensError(f"method {method.name!r}: a chain stage's config needs the fields {', '.join(missing)} "
                             "(or register it with stage=False)")
    names.declare(method.name, stage=method.stage)
    REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a method registered later (tests undo what they register); es and grpo stay."""
    names.forget(name)
    REGISTRY.pop(name, None)


def find(name) -> Method | None:
    """The method called `name`, None for anything else (a chain's name included)."""
    return REGISTRY.get(name) if isinstance(name, str) else None


def get(name: str) -> Method:
    """The method called `name`; anything else is refused with the known names."""
    m = find(name)
    if m is None:
        raise DeltalensError(f"unknown method {name!r}; use one of {', '.join(REGISTRY)}")
    return m


def registered() -> tuple[Method, ...]:
    """Every method, in registration order (es, grpo, then any added)."""
    return tuple(REGISTRY.values())


# --------------------------------------------------------------------------------------------- ES, GRPO
# the trainers load torch (and TRL): imported when a run trains


def _train_es(config, out, resume=False, progress=None, **kw):
    from deltalens.training.es.train import train_es

    return train_es(config, out, resume, progress, **kw)


def _es_problems(task, config, n: int) -> list:
    from deltalens.training.es.strategy import iteration_problems

    return [p for it in range(1, n + 1) for p in iteration_problems(task, config, it)]


def _train_grpo(config, out, resume=False, progress=None, **kw):
    from deltalens.training.grpo.train import train_grpo

    return train_grpo(config, out, resume, progress, **kw)


def _grpo_problems(task, config, n: int) -> list:
    from deltalens.training.grpo.train import run_problems

    return run_problems(task, config, 1, n)


register(Method(
    "es", ESConfig, _train_es,
    units=lambda c, n: es_units(n, c.prompts_per_iteration, c.population),
    count_for_budget=lambda c, b: iterations_for_budget(b, c.prompts_per_iteration, c.population),
    problems=_es_problems, start_from="model",
    summary="Evolution Strategies (Qiu et al. 2025): seeded in-place population search; exact resume."))
register(Method(
    "grpo", GRPOConfig, _train_grpo,
    units=lambda c, n: grpo_units(n, c.prompts_per_step, c.num_generations),
    count_for_budget=lambda c, b: steps_for_budget(b, c.prompts_per_step, c.num_generations),
    problems=_grpo_problems, start_from="init_from",
    summary="GRPO through TRL's GRPOTrainer, with the paper's settings set explicitly; exact resume."))
