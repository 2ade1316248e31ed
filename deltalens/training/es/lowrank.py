"""Low-rank ES noise (EGGROLL, arXiv 2511.16652): rank-r perturbations of the 2-D weights, seeded.

With `ESConfig(noise="lowrank", rank=r)` every trained 2-D tensor W (out x in: linear weights, the
embedding, lm_head) is perturbed by a rank-r matrix instead of a dense ε:

    E_k = A_k B_kᵀ / √r,  A_k ~ N(0, 1)^(out x r),  B_k ~ N(0, 1)^(in x r)   (entries of E_k: variance 1)
    θ_i = θ + sign_i σ E_k                     member i uses noise vector k = member_noise(i), sign ±1
    θ ← θ + (α/N) Σ_k c_k E_k = θ + (α / (N√r)) · (A_cat diag(c)) B_catᵀ,   c_k = Σ_{i using k} sign_i z_i

so the update is one (out x Kr) @ (Kr x in) matmul per tensor (A_cat = [A_1 .. A_K], K noise vectors),
never N dense matrices. Tensors that are not 2-D (RMSNorm weights, biases) keep the full-rank ε of
`deltalens.training.es.engine` (same seeds, same blocks): they are small, and a rank-1 perturbation of a vector is a
scaled copy of one random vector, which is not what ES needs there. EGGROLL does the same.

Seeds: the factors of (iteration, noise vector k, tensor) come from one CPU generator seeded with
`noise_seed(seed, iteration, k, b, K, n_blocks)`, b = the tensor's first block id (the numbering full-rank
noise uses), A drawn first, then B. `LowRankNoise` is a noise family (`deltalens.training.es.noise`): it
takes the 2-D tensors whole (`bind`) and leaves the others to the Gaussian blocks it inherits. So they are unique within a run and regenerated, never stored: the
sequential engine (`ESEngine.perturb` materialises W += sign·σ/√r · A Bᵀ in place, restore copies the
base back, exactly), the population-batched path (`deltalens.training.es.population`, which never forms W + σE) and
`deltalens.analysis.diversity` (members rebuilt from seeds) all see the same noise.

Measured against full-rank noise on tiny: docs/tuning.md.

Departures from EGGROLL: it draws A, B with a counter-based RNG in JAX and applies the perturbation only
inside the batched forward; we draw them with torch's CPU generator (as the full-rank noise) and also
support materialising members in place, so every sequential tool works unchanged. EGGROLL's fitness
shaping and learning-rate schedule are not adopted; the update is the one of `deltalens.training.es.engine`.
"""

from __future__ import annotations

import math
import time

import torch

from deltalens.training.es.noise import GaussianNoise, register


@register
class LowRankNoise(GaussianNoise):
    """Low-rank noise (`ESConfig(noise="lowrank", rank=r)`): a noise family that takes every trained 2-D
    tensor whole (`bind`) and leaves the others to the Gaussian blocks of its base class.

    `items`: (position j among the trained tensors, name, tensor, first block id) of each low-rank tensor.
    """

    name = "lowrank"

    def __init__(self, seed: int, n_noise: int, n_blocks: int, rank: int = 1):
        super().__init__(seed, n_noise, n_blocks)
        self.rank = rank
        self.scale = 1.0 / math.sqrt(rank)  # E = A Bᵀ / √r

    @classmethod
    def options(cls, config) -> dict:
        return {"rank": config.rank}

    def bind(self, tensors) -> set[int]:
        self.items = [(j, name, p, block) for j, name, p, block in tensors if p.dim() == 2]
        return {j for j, _, _, _ in self.items}

    def factors(self, iteration: int, k: int, item) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [out, r], B [in, r]) fp32 of noise vector k for one item, from its seed."""
        _, _, p, block = item
        gen = self.generator(iteration, k, block)
        a = torch.randn(p.shape[0], self.rank, generator=gen)
        b = torch.randn(p.shape[1], self.rank, generator=gen)
        return a, b

    def dense(self, iteration: int, k: int, j: int) -> torch.Tensor:
        """E_k = A Bᵀ / √r of trained tensor j as a dense fp32 tensor (tests, diversity)."""
        item = next(it for it in self.items if it[0] == j)
        a, b = self.factors(iteration, k, item)
        return (a @ b.T).mul_(self.scale)  # on the CPU, like `ESEngine.noise_of`

    def shift(self, iteration: int, k: int, s: float, timing: dict) -> None:
        """W += s·E_k in place for every item (fp32 arithmetic, rounded once to the weight dtype)."""
        self._shift(iteration, k, s, timing)

    def shift_into(self, iteration: int, k: int, s: float, dst_of, timing: dict) -> None:
        """dst_of(W) ← W + s·E_k for every item, W untouched (`shift`'s fp32 arithmetic, one cast to the
        destination: a member written into a bf16 compute copy)."""
        self._shift(iteration, k, s, timing, dst_of)

    @torch.no_grad()
    def _shift(self, iteration: int, k: int, s: float, timing: dict, dst_of=None) -> None:
        for item in self.items:
            t0 = time.perf_counter()
            a, b = self.factors(iteration, k, item)
            t1 = time.perf_counter()
            w = item[2].detach()
            a, b = a.to(w.device), b.to(w.device)
            if dst_of is not None:
                dst_of(item[2]).copy_(torch.addmm(w.float(), a, b.T, alpha=s * self.scale))
            elif w.dtype == torch.float32:
                w.addmm_(a, b.T, alpha=s * self.scale)
            else:
                w.copy_(w.float().addmm_(a, b.T, alpha=s * self.scale))
            timing["noise_s"] += t1 - t0
            timing["perturb_restore_s"] += time.perf_counter() - t1

    @torch.no_grad()
    def update(self, iteration: int, coeff: list[float], scale: float, timing: dict) -> float:
        """W += scale · Σ_k coeff_k E_k for every item, one matmul per tensor; returns Σ (update)²."""
        ks = [k for k, c in enumerate(coeff) if c != 0.0]  # skipped identically on every replica
        sq = 0.0
        if not ks:
            return sq
        for item in self.items:
            t0 = time.perf_counter()
            pairs = [self.factors(iteration, k, item) for k in ks]
            t1 = time.perf_counter()
            c = torch.tensor([coeff[k] for k in ks], dtype=torch.float32).repeat_interleave(self.rank)
            a_cat = torch.cat([a for a, _ in pairs], dim=1).mul_(c)  # A_cat diag(c), [out, K r]
            b_cat = torch.cat([b for _, b in pairs], dim=1)  # [in, K r]
            alpha = scale * self.scale
            # ‖alpha·A Bᵀ‖² = alpha² Σ (AᵀA) ∘ (BᵀB): two (Kr x Kr) Gram matrices, float64
            a64, b64 = a_cat.double(), b_cat.double()
            sq += alpha * alpha * float(((a64.T @ a64) * (b64.T @ b64)).sum())
            w = item[2].detach()
            a_cat, b_cat = a_cat.to(w.device), b_cat.to(w.device)
            if w.dtype == torch.float32:
                w.addmm_(a_cat, b_cat.T, alpha=alpha)
            else:
                w.copy_(w.float().addmm_(a_cat, b_cat.T, alpha=alpha))
            timing["update_noise_s"] = timing.get("update_noise_s", 0.0) + t1 - t0
            timing["update_apply_s"] = timing.get("update_apply_s", 0.0) + time.perf_counter() - t1
        return sq

    def member_factors(self, iteration: int, users, count: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per item j: (A [count, out, r] = s/√r·A_k, B [count, in, r] = B_k) fp32 on the CPU, row g of
        member (g, s) of users[k]: the batched forward adds (x B_g)(A_g)ᵀ to the shared x Wᵀ."""
        out = {}
        for item in self.items:
            p = item[2]
            a_st = torch.empty(count, p.shape[0], self.rank)
            b_st = torch.empty(count, p.shape[1], self.rank)
            for k, rows in users.items():
                a, b = self.factors(iteration, k, item)
                for g, s in rows:
                    a_st[g] = a * (s * self.scale)
                    b_st[g] = b
            out[item[0]] = (a_st, b_st)
        return out
