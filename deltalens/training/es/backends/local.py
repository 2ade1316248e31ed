"""Local backend: members evaluated in this process, on the driver's own replica.

One by one (`ESEngine.evaluate_members`: perturb in place, generate, restore; with bf16 compute each
member written into the bf16 copy instead), or with
`population_batch` > 1 several members per batched generation (`deltalens.training.es.population`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from deltalens.training.es.engine import ESEngine, new_timing
from deltalens.training.es.population import evaluate_batched


class LocalBackend:
    name = "local"

    def __init__(self, engine: ESEngine):
        self.engine = engine

    def evaluate(self, iteration: int, problems) -> tuple[list[float], dict]:
        timing = new_timing()
        cfg = self.engine.config
        members = range(cfg.population)
        if cfg.population_batch > 1:
            r = evaluate_batched(self.engine, iteration, members, problems, timing)
        else:
            r = self.engine.evaluate_members(iteration, members, problems, timing)
        return [r[i] for i in members], timing

    def update(self, iteration: int, z: Sequence[float]) -> dict:
        out = self.engine.update(iteration, z)
        t0 = time.perf_counter()
        out["checksum"] = self.engine.checksum()
        out["checksum_s"] = time.perf_counter() - t0
        return out

    def close(self) -> None:
        pass
