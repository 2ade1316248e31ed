"""Who evaluates the ES members: `local` (in-process), `ray` (actors) or `vllm` (a vLLM engine).

Every backend has the same interface (`MemberBackend`), and the engine imports none of them: the
training loop (`deltalens.training.es.train`) picks one with `make_member_evaluator`. Each derives the prompts and
the noise from (seed, iteration, member) itself, so only iteration numbers, member ids, rewards and the
shaped fitness z cross a process boundary, never weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from deltalens.training.es.backends.local import LocalBackend
from deltalens.training.es.config import ESConfig
from deltalens.training.es.engine import ESEngine


class MemberBackend(Protocol):
    name: str

    def evaluate(self, iteration: int, problems) -> tuple[list[float], dict]:
        """Rewards of all N members of `iteration` (in member order) and timings."""

    def update(self, iteration: int, z: Sequence[float]) -> dict:
        """Apply θ += (α/N) Σ z_i ε_i everywhere; returns timings, update_rms and the weights checksum."""

    def close(self) -> None: ...


def make_member_evaluator(config: ESConfig, engine: ESEngine, model_spec: str, options: dict | None = None) -> MemberBackend:
    if config.backend == "local":
        return LocalBackend(engine)
    if config.backend == "vllm":  # perturbs vLLM's own fused weights in place (docs/vllm.md)
        from deltalens.training.es.backends.vllm import VLLMESBackend

        return VLLMESBackend(engine, model_spec, **(options or {}))
    from deltalens.training.es.backends.ray import RayBackend

    return RayBackend(engine, model_spec, **(options or {}))


__all__ = ["LocalBackend", "MemberBackend", "make_member_evaluator"]
