"""`deltalens demo`: the study (`deltalens.study`) on the bundled tiny model with a small budget, one seed.

    deltalens demo                      # ~5-10 min on 2 CPU cores: writes deltalens-demo/report.html
    deltalens demo --budget 4           # 4x the training compute (iterations / steps)

ES (tiny preset) for 8 ES iterations' worth of compute units (x --budget), GRPO (tiny preset) and
ES->GRPO at the same FLOP-matched budget; Pass@1/16/32 of the base and all three on 100 test problems x 32
samples; the weight diff; sparsification with its controls; population diversity of the ES run; token
entropy; a held-out task; every claim's checks, and the HTML report. This is a demonstration at toy
scale (one seed, small budgets): its verdicts mostly say "unclear", which is the honest answer of one
seed; `deltalens study` with several seeds is the measurement.

`DemoConfig` is the command's options (`deltalens demo --help`, `--config FILE`), the arguments of
`demo_config`. The module is torch-free until `run_demo` runs the study, so the CLI builds its options cheaply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from deltalens.config import Config, option
from deltalens.errors import DeltalensError
from deltalens.evaluation.options import shared
from deltalens.study.config import StudyConfig
from deltalens.training.budget import es_units
from deltalens.training.es.config import ESConfig

DEMO_ES_ITERATIONS = 8  # ES iterations of the tiny preset at --budget 1: the unit every method is matched to


@dataclass
class DemoConfig(Config):
    """Options of `deltalens demo` (one help line each): the arguments of `demo_config`."""

    METHOD: ClassVar[str] = "demo"
    NAME: ClassVar[str] = "demo"

    budget: float = option(1.0, "training compute scale (1 = 8 ES iterations' worth)")
    limit: int = option(100, "test problems evaluated per model")
    samples: int = shared("samples")
    seed: int = shared("seed")


def demo_config(budget: float = 1.0, limit: int = 100, samples: int = 32, seed: int = 0) -> StudyConfig:
    """The study the demo runs (see module docstring)."""
    if not budget > 0:
        raise DeltalensError(f"--budget must be > 0 (got {budget}); 1 is the default demo size")
    es = ESConfig.preset("tiny")
    units = es_units(max(1, round(DEMO_ES_ITERATIONS * budget)), es.prompts_per_iteration, es.population)
    return StudyConfig(model="tiny", task="arith", methods=("es", "grpo", "es-grpo"), seeds=(seed,), budget=units,
                       base_seeds=1, limit=limit, samples=samples, k=tuple(k for k in (1, 16, 32) if k <= samples)
                       or (1,), sparsity=(0.5, 0.9, 0.99), diversity_members=8, diversity_prompts=8,
                       entropy_prompts=min(limit, 100), held_out=("arith-3",))


def run_demo(out: str = "deltalens-demo", budget: float = 1.0, limit: int = 100, samples: int = 32, seed: int = 0,
             progress_factory=None, log: Callable[[str], None] = print) -> dict:
    """Run the demo study into `out`; returns the analysis document."""
    from deltalens.study.run import run_study  # the study's measurements load torch

    return run_study(demo_config(budget, limit, samples, seed), out, log=log, progress_factory=progress_factory)
