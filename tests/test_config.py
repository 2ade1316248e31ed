"""deltalens.config: types, unknown keys, precedence, `needs`, budgets decided once."""

from __future__ import annotations

import pytest

from deltalens.config import coerce
from deltalens.errors import DeltalensError
from deltalens.training.es.config import ESConfig
from deltalens.training.grpo.config import GRPOConfig


@pytest.mark.parametrize(("value", "tp", "want"), [
    ("a,b", tuple[str, ...], ("a", "b")), (["a"], tuple[str, ...], ("a",)), (3, float, 3.0), ("2e-3", float, 2e-3),
    (4.0, int, 4), (None, int | None, None), ("1.5M", float | str | None, "1.5M"), (7, float | str | None, 7.0),
])
def test_coerce(value, tp, want):
    assert coerce(value, tp, "x", "test") == want


@pytest.mark.parametrize(("value", "tp"), [(True, int), (1, bool), ("x", int), (4.5, int), (None, int), ([1], str)])
def test_coerce_refuses(value, tp):
    with pytest.raises(DeltalensError, match="test: x must be"):
        coerce(value, tp, "x", "test")


def test_round_trip_and_unknown_keys():
    cfg = ESConfig.preset("tiny", iterations=5)
    d = cfg.to_dict()
    assert d["method"] == "es" and d["params"] == ["*"] and ESConfig.from_dict(d) == cfg
    with pytest.raises(DeltalensError, match="unknown ES option"):
        ESConfig.from_dict({**d, "lr": 1.0})
    with pytest.raises(DeltalensError, match="is a 'es' config, not 'grpo'"):
        GRPOConfig.from_dict(d)


def test_preset_overrides_keep_the_needs_rules():
    """`Config.preset(name, **overrides)` (the Python API) refuses an override its config does not use, as the
    command line and YAML do; the same option left at the preset's value is no refusal."""
    with pytest.raises(DeltalensError, match="--shared-prefix is only used when --population-batch is 2 or more"):
        ESConfig.preset("smollm2", population_batch=0, shared_prefix=False)
    with pytest.raises(DeltalensError, match="--rank 2 needs --noise lowrank"):
        ESConfig.preset("tiny", noise="full", rank=2)
    cfg = ESConfig.preset("smollm2", population_batch=0)  # shared_prefix stays the preset's, unused
    assert cfg.population_batch == 0 and not cfg.in_use("shared_prefix")
    assert ESConfig.preset("smollm2", shared_prefix=False).shared_prefix is False


def test_budget_decides_the_count_once():
    cfg = ESConfig(budget="64k", population=4, prompts_per_iteration=8)  # 2·4·8 = 64 units per iteration
    assert (cfg.iterations, cfg.budget) == (1000, 64000.0)
    assert ESConfig.from_dict(cfg.to_dict()) == cfg  # both stored, and they agree
    with pytest.raises(DeltalensError, match="disagree"):
        ESConfig(budget=6400, iterations=3, population=4, prompts_per_iteration=8)
    assert ESConfig().iterations == 100 and GRPOConfig().steps == 100
    g = GRPOConfig(budget=1e4, prompts_per_step=8, num_generations=8)  # 8·8·8 = 512 per step
    assert g.steps == 19


def test_resolve_precedence():
    cfg = ESConfig.resolve(preset="tiny", yaml={"sigma": 0.01, "population": 8}, given={"population": 6})
    assert (cfg.alpha, cfg.sigma, cfg.population) == (ESConfig.preset("tiny").alpha, 0.01, 6)
    stored = ESConfig(budget=6400, population=4, prompts_per_iteration=8).to_dict()
    del stored["method"]
    grown = ESConfig.resolve(stored=stored, given={"iterations": 150})  # an explicit count replaces the budget
    assert (grown.iterations, grown.budget) == (150, None)


def test_a_least_value_is_refused_from_every_source():
    """`option(min=...)`: a YAML value or a command-line value below it is refused in one line (typer checks
    the flag too); the command line still overrides the file."""
    from deltalens.evaluation.options import EvalConfig

    with pytest.raises(DeltalensError, match=r"^the config file: seed must be >= 0 \(got -1\)$"):
        EvalConfig.resolve(yaml={"seed": -1})
    with pytest.raises(DeltalensError, match="command line: seed must be >= 0"):
        EvalConfig.resolve(given={"seed": -2})
    assert EvalConfig.resolve(yaml={"seed": 2, "label": ["a,b", "c"]}, given={"seed": 3}) == \
        EvalConfig(seed=3, label=("a,b", "c"))


def test_every_commands_config_is_defined_below_the_cli():
    """The CLI generates its options from config dataclasses that live in deltalens/ (the sweep's in
    deltalens.study.config, the demo's in deltalens.demo, the probe's temperatures in ProbeConfig), never
    subclasses of its own."""
    import importlib
    import inspect
    import pkgutil

    import deltalens.cli

    from deltalens.config import Config

    found = set()
    for info in pkgutil.iter_modules(deltalens.cli.__path__):
        mod = importlib.import_module(f"deltalens.cli.{info.name}")
        for obj in vars(mod).values():
            if inspect.isclass(obj) and issubclass(obj, Config) and obj is not Config:
                assert not obj.__module__.startswith("deltalens.cli"), obj
                found.add(f"{obj.__module__}.{obj.__name__}")
    assert {"deltalens.study.config.SweepConfig", "deltalens.demo.DemoConfig",
            "deltalens.analysis.options.ProbeConfig"} <= found
