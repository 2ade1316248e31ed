"""Ray backend for ES: members evaluated by actors that each hold a model replica.

    driver (ESEngine: updates, eval, checkpoints)
      ├─ actor 0 (ESEngine replica)     evaluate(iteration, [member]) -> {member: reward}
      ├─ actor 1 ...                    update(iteration, z)          -> checksum
      └─ ...

Per iteration the driver sends only (iteration, member id) to actors and gathers one float per member;
each replica derives the prompts and the noise from (seed, iteration, member), exactly as the local
backend does. After the rewards are in, the driver sends the shaped fitness z (N floats) to every
actor; every replica, the driver's included, applies the same update from (seeds, z), and the weight
checksums (blake2b of every parameter's bytes) must all agree: no weights cross the network during
training. Members are handed out one at a time to whichever actor is idle, so results are keyed by
member, not by actor, and a run gives the same weights as the in-process backend, bit for bit (the
forward pass must be deterministic on every replica: same code, same threads, same CPU kind).

Fault tolerance: an actor that dies mid-iteration (RayActorError) has its member put back in the
queue and re-run by another actor, with an identical result since a member's reward depends only on
(weights, iteration, member). A replacement actor is started in the background; it loads the model
spec, receives the driver's current weights once (the only time weights are sent), and joins after
its checksum matches. An exception raised *inside* a task (a bug, not a death) is re-raised.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Sequence

import torch

from deltalens.errors import DeltalensError

try:
    import ray
    from ray.exceptions import RayActorError
except ImportError as e:  # pragma: no cover - exercised only without ray
    raise DeltalensError("the ray backend needs ray: pip install ray (or use --backend local)") from e

from deltalens.io.models import apply_state_dict, load_model
from deltalens.training.es.config import ESConfig
from deltalens.training.es.engine import ESEngine, new_timing
from deltalens.training.run import make_task


class ESWorker:
    """Actor body: one model replica (an `ESEngine`)."""

    def __init__(self, config: dict, model_spec: str, threads: int, fail_at: tuple[int, int] | None = None):
        torch.set_num_threads(threads)
        cfg = ESConfig.from_dict(config)
        model, tok = load_model(model_spec, dtype=cfg.dtype)
        self.engine = ESEngine(model, tok, make_task(cfg), cfg)
        self.fail_at = tuple(fail_at) if fail_at else None  # test hook: die at (iteration, member)

    def checksum(self) -> str:
        return self.engine.checksum()

    def evaluate(self, iteration: int, members: Sequence[int]) -> tuple[dict[int, float], dict]:
        if self.fail_at and self.fail_at[0] == iteration and self.fail_at[1] in members:
            os._exit(1)  # simulate a crash mid-iteration
        timing = new_timing()
        return self.engine.evaluate_members(iteration, members, None, timing), timing

    def update(self, iteration: int, z: Sequence[float]) -> str:
        self.engine.update(iteration, z)
        return self.engine.checksum()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> str:
        """Replace the replica's weights (used once, when a replacement actor joins)."""
        apply_state_dict(self.engine.model, weights, source="driver weights")
        self.engine._base = None  # re-taken from the new weights at the next perturbation
        return self.engine.checksum()


class RayBackend:
    """Evaluate members on Ray actors; see the module docstring."""

    name = "ray"

    def __init__(self, engine: ESEngine, model_spec: str, fail_at: tuple[int, int] | None = None,
                 max_restarts: int | None = None):
        cfg = engine.config
        self.engine, self.model_spec, self.cfg = engine, model_spec, cfg
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
        self._actor_cls = ray.remote(num_cpus=cfg.threads_per_worker, max_restarts=0)(ESWorker)
        self.restarts_left = cfg.workers * 2 if max_restarts is None else max_restarts
        self.restarts = 0
        self.workers: dict[int, object] = {}  # live actors by id
        self.joining: dict[object, int] = {}  # future of a replacement's load_weights -> actor id
        self._next_id = 0
        for i in range(cfg.workers):
            self._spawn(fail_at if i == 0 else None)
        want = engine.checksum()
        got = ray.get([w.checksum.remote() for w in self.workers.values()])
        if any(g != want for g in got):
            self.close()
            raise DeltalensError(f"Ray workers loaded different weights from {model_spec} than the driver "
                                 "(is the path visible to every node?)")

    # -- actors
    def _spawn(self, fail_at=None) -> int:
        wid = self._next_id
        self._next_id += 1
        self.workers[wid] = self._actor_cls.remote(self.cfg.to_dict(), self.model_spec,
                                                   self.cfg.threads_per_worker, fail_at)
        return wid

    def _replace(self, wid: int) -> None:
        """Drop dead actor `wid` and start a replacement that joins once it holds the driver's weights."""
        self.workers.pop(wid, None)
        if self.restarts_left <= 0:
            if not self.workers and not self.joining:
                raise DeltalensError("all Ray workers died and the restart budget is spent; "
                                     "see the Ray logs (/tmp/ray/session_latest/logs)")
            return
        self.restarts_left -= 1
        self.restarts += 1
        new = self._spawn()
        actor = self.workers.pop(new)
        weights = ray.put({n: p.detach().clone() for n, p in self.engine.model.state_dict().items()})
        self.joining[actor.load_weights.remote(weights)] = (new, actor)

    def _poll_joining(self, timeout: float = 0) -> None:
        if not self.joining:
            return
        ready, _ = ray.wait(list(self.joining), num_returns=len(self.joining), timeout=timeout)
        want = self.engine.checksum() if ready else None
        for f in ready:
            wid, actor = self.joining.pop(f)
            try:
                got = ray.get(f)
            except RayActorError:  # the replacement itself died: try again while the budget lasts
                self._replace(wid)
                continue
            if got != want:
                raise DeltalensError("a replacement Ray worker does not match the driver's weights after "
                                     "loading them; the replicas are not deterministic")
            self.workers[wid] = actor

    # -- the backend interface
    def evaluate(self, iteration: int, problems=None) -> tuple[list[float], dict]:
        """Rewards of all members; each member goes to the next idle actor (re-queued if its actor dies)."""
        n = self.cfg.population
        queue = deque(range(n))
        rewards: dict[int, float] = {}
        timing = new_timing()
        pending: dict[object, tuple[int, int]] = {}  # future -> (actor id, member)
        t0 = time.perf_counter()
        while len(rewards) < n:
            self._poll_joining()
            busy = {wid for wid, _ in pending.values()}
            for wid in [w for w in self.workers if w not in busy]:
                if not queue:
                    break
                m = queue.popleft()
                pending[self.workers[wid].evaluate.remote(iteration, [m])] = (wid, m)
            if not pending:
                if not self.joining:
                    raise DeltalensError("no Ray workers left to evaluate members")
                self._poll_joining(timeout=1.0)
                continue
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for f in ready:
                wid, m = pending.pop(f)
                try:
                    r, t = ray.get(f)
                except RayActorError:
                    queue.appendleft(m)  # re-run elsewhere: same weights, same seeds, same reward
                    self._replace(wid)
                    continue
                rewards.update(r)
                for k, v in t.items():
                    timing[k] += v
        timing["evaluate_wall_s"] = time.perf_counter() - t0
        return [rewards[i] for i in range(n)], timing

    def update(self, iteration: int, z: Sequence[float]) -> dict:
        """Every replica applies the same update; checksums must agree with the driver's."""
        self._poll_joining(timeout=None)  # replacements hold this iteration's weights: let them join first
        futures = {self.workers[w].update.remote(iteration, list(z)): w for w in self.workers}
        out = self.engine.update(iteration, z)  # the driver's replica, meanwhile
        t0 = time.perf_counter()
        want = self.engine.checksum()
        out["checksum"] = want
        for f, wid in futures.items():
            try:
                got = ray.get(f)
            except RayActorError:
                self._replace(wid)  # the replacement receives the driver's updated weights
                continue
            if got != want:
                raise DeltalensError(f"Ray worker {wid} diverged from the driver after iteration {iteration} "
                                     f"(checksum {got[:8]} vs {want[:8]}); replicas must run identical code")
        out["checksum_s"] = time.perf_counter() - t0
        out["workers"] = {"live": len(self.workers), "restarts": self.restarts}
        return out

    def close(self) -> None:
        for actor in list(self.workers.values()) + [a for _, a in self.joining.values()]:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor)
        self.workers.clear()
        self.joining.clear()
        if self._owns_ray:
            ray.shutdown()
