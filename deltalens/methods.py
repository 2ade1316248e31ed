"""Training methods by name, torch-free: what a run's config.json may say in "method", and how chains
of methods are named. The layers that must not load a trainer (the analysis documents, the study's
options) ask here.

    names()                 ("es", "grpo")            single-run methods, in registration order
    stage_names()           ("es", "grpo")            the methods a chain may hold (every registered one
                                                      unless registered with stage=False)
    chain_name(["es", "grpo"])    "es-grpo"           what a chain's config.json says in "method"
    chain_stages("grpo-es") ("grpo", "es")            None for anything that is not a chain's name
    chains()                ("es-grpo", "grpo-es")    the two-stage chains of distinct methods
    run_methods()           names() + chains()        what `deltalens study --methods` accepts
    is_run_method("es-grpo-es")   True                any single method or any chain of stage methods

The registry proper (config class, train function, budget unit) is `deltalens.training.methods`;
registering a method there declares its name here, as a chain stage unless it says otherwise
(`Method.stage`): a chain (`deltalens.training.chain`) holds any stage method, its stage options under
its name. es and grpo are declared here as well (BUILT_IN), so their names are known without importing
any training code; they cannot be dropped.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

from deltalens.errors import DeltalensError

NAME = re.compile(r"[a-z][a-z0-9_]*")  # no "-": it joins a chain's stages
RESERVED = ("chain", "resume")  # `deltalens train` subcommands that are not methods
BUILT_IN = ("es", "grpo")  # declared below; never dropped
_STAGE: dict[str, bool] = {}  # name -> a chain may hold it


def declare(name: str, *, stage: bool = False) -> None:
    """Make `name` a known method (idempotent); `stage`: a chain may hold it."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or name in RESERVED:
        raise DeltalensError(f"a method name is lowercase letters, digits and _, not {', '.join(RESERVED)} "
                             f"(got {name!r})")
    _STAGE[name] = _STAGE.get(name, False) or stage


def forget(name: str) -> None:
    """Drop a method declared later (tests undo what they register); es and grpo stay."""
    if name in BUILT_IN:
        raise DeltalensError(f"{name} is a built-in method and chain stage; it cannot be dropped")
    _STAGE.pop(name, None)


def names() -> tuple[str, ...]:
    """The single-run methods: es, grpo, then any registered later."""
    return tuple(_STAGE)


def stage_names() -> tuple[str, ...]:
    """The methods a chain may hold, in registration order (es, grpo, then any registered later as stages)."""
    return tuple(m for m, stage in _STAGE.items() if stage)


def chain_name(stages: Sequence[str]) -> str:
    """What a chain of `stages` says in its config.json's "method": es-grpo."""
    return "-".join(stages)


def chain_stages(name) -> tuple[str, ...] | None:
    """The stages a chain's method name joins (es-grpo -> (es, grpo)); None unless it joins two or more
    stage methods."""
    if not isinstance(name, str) or "-" not in name:
        return None
    stages = tuple(name.split("-"))
    return stages if all(_STAGE.get(s) for s in stages) else None


def chains() -> tuple[str, ...]:
    """The two-stage chains of distinct stage methods: es-grpo, grpo-es."""
    return tuple(chain_name(p) for p in itertools.permutations(stage_names(), 2))


def run_methods() -> tuple[str, ...]:
    """Every single method and two-stage chain: es, grpo, es-grpo, grpo-es."""
    return names() + chains()


def is_run_method(name) -> bool:
    """`name` is what a deltalens run's config.json says in "method": a method or a chain of them."""
    return (isinstance(name, str) and name in _STAGE) or chain_stages(name) is not None


for _name in BUILT_IN:
    declare(_name, stage=True)
