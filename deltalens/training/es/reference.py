"""ES in the arithmetic of Qiu et al.'s public script (countdown/es_fine-tuning_countdown.py), as an option
beside ours (`ESConfig(arithmetic="reference")`), so that findings about *where* ES changes the weights
can be tested in both.

What the reference script does, per iteration (members i with integer seeds s_i drawn in [0, 2^30)):

    perturb   for every parameter p:  g = Generator().manual_seed(s_i);  ε = randn(p.shape, dtype=p.dtype, g)
              p += σ·ε                   (in the weight dtype: bf16 in the paper's runs)
    restore   the same loop with p += -σ·ε   (subtraction of the regenerated noise, no copy)
    update    for every parameter p:  u = zeros_like(p);  for each member: u += z_i·ε_i (weight dtype)
              u /= N;  p += α·u

Three consequences that our arithmetic (`strategy`, `engine`) avoids: (a) a fresh generator with the
member's seed for *every* tensor gives all same-shaped tensors of a member the identical ε (e.g. q_proj
of every layer, all RMSNorm weights); (b) noise and the update are drawn and accumulated in the weight
dtype; (c) in bf16, p + σε − σε is not p: restoring by subtraction leaves each weight up to one bf16 step
away from where it started (a step is 2^-8 |p|, larger than σ at |p| ~ 1, e.g. RMSNorm weights), every
member of every iteration. Here member seeds come from `noise_seed` (one per member and iteration,
deterministic, so runs resume exactly); the fitness shaping stays the config's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from deltalens.training.es.strategy import member_noise, noise_seed

SEED_RANGE = 1 << 30  # the reference draws np.random.randint(0, 2**30)


class ReferenceArithmetic:
    """Perturb / restore / update of one `ESEngine`'s trained tensors the way the reference script does."""

    def __init__(self, engine):
        self.engine = engine
        self.params = [p for _, _, p in engine.params]

    def member_seed(self, iteration: int, k: int) -> int:
        """The one seed of noise vector k in `iteration`, used for every tensor (the reference's layout)."""
        cfg = self.engine.config
        return noise_seed(cfg.seed, iteration, k, 0, self.engine.n_noise, 1) % SEED_RANGE

    @staticmethod
    def noise(p: torch.Tensor, seed: int) -> torch.Tensor:
        """ε for tensor p: a fresh CPU generator with the member's seed, drawn in p's dtype."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device)

    @torch.no_grad()
    def shift(self, iteration: int, member: int, s: float, timing: dict) -> None:
        """p += s·ε_member for every trained tensor, in the weight dtype (perturb: s = ±σ; restore: ∓σ)."""
        k, sign = member_noise(member, self.engine.config.antithetic)
        seed = self.member_seed(iteration, k)
        for p in self.params:
            t0 = time.perf_counter()
            eps = self.noise(p, seed)
            t1 = time.perf_counter()
            p.add_(sign * s * eps)
            timing["noise_s"] += t1 - t0
            timing["perturb_restore_s"] += time.perf_counter() - t1

    @torch.no_grad()
    def update(self, iteration: int, z: Sequence[float]) -> dict:
        """p += α · (Σ_i z_i ε_i) / N, accumulated in the weight dtype, member by member."""
        cfg = self.engine.config
        t0, noise_s, sq = time.perf_counter(), 0.0, 0.0
        members = [(self.member_seed(iteration, k), sign, float(zi))
                   for i, zi in enumerate(z) for k, sign in [member_noise(i, cfg.antithetic)]]
        for p in self.params:
            u = torch.zeros_like(p)
            for seed, sign, zi in members:
                t1 = time.perf_counter()
                eps = self.noise(p, seed)
                noise_s += time.perf_counter() - t1
                u.add_(eps.mul_(sign * zi))
            u.div_(cfg.population)
            step = cfg.alpha * u
            sq += float(step.double().square().sum())
            p.add_(step)
        n = sum(p.numel() for p in self.params)
        return {"update_s": time.perf_counter() - t0, "update_noise_s": noise_s,
                "update_rms": math.sqrt(sq / max(n, 1))}
