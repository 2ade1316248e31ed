"""The ES strategy: noise seeds, member layout, fitness shaping and the update's arithmetic.

State vs hyperparameters (evosax OpenES style): the state of a run is (run seed, step) plus the weights;
every ε is a function of (seed, step, member, block) and is regenerated when needed, never stored. This
module does not know who evaluates the members (the backends in `deltalens.training.es.backends` do):
it only turns rewards into update coefficients and seeds into noise.

Noise seeds. Qiu et al.'s reference script seeds a fresh generator with the *member's* seed for *every*
tensor, so all same-shaped tensors of a member get the identical ε. We seed each (step, member, block)
separately, where a block is a tensor or a 4M-element chunk of a larger one, numbered over all
parameters of the model: the noise of a tensor does not depend on which other tensors are trained
(`params` filter), blocks can be drawn in parallel threads with identical results, noise buffers stay
small, and no two tensors share noise. The seed is a keyed bijection of the counter
((step-1)·K + noise index)·B + block (K noise vectors per step, B blocks), not a hash of names: torch's
CPU generator (mt19937) keeps only the low 32 bits of a seed (`manual_seed(1)` and `manual_seed(1 + 2**32)`
give the same stream), and 32-bit hashes collide by the birthday bound (~1000 colliding pairs in a
500-step run of a 200-tensor model). A bijection of a counter cannot collide: within a run no two
(step, member, block) share noise.

Arithmetic. Every perturbation and update is computed in fp32 and rounded to the weight dtype once
(`add_scaled`); the update θ += (α/N) Σ_k c_k ε_k is accumulated over the noise vectors in fp32, in k
order, identically on every backend (`accumulate_noise`), so replicas stay bit-identical. The reference
script draws noise and accumulates in the model dtype (bf16).
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Sequence

import torch

from deltalens.errors import DeltalensError

_M32 = 0xFFFFFFFF
CHUNK = 1 << 22  # noise block: at most 4M elements (16 MiB fp32) of one tensor share a generator


def _mix32(x: int, key: int) -> int:
    """A keyed bijection of [0, 2^32): xor with the key, then the `lowbias32` integer hash.

    Every step (xor, xorshift-right, multiplication by an odd constant mod 2^32) is invertible, so
    distinct inputs always give distinct outputs.
    """
    x = (x ^ key) & _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return x


def run_key(seed: int) -> int:
    """32-bit key of a run seed (blake2b), so different runs use different noise."""
    h = hashlib.blake2b(f"deltalens-es/{seed}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little")


def noise_seed(seed: int, iteration: int, noise_index: int, block: int, n_noise: int, n_blocks: int) -> int:
    """The generator seed of one (iteration >= 1, noise vector, block): unique within a run.

    counter = ((iteration-1)·n_noise + noise_index)·n_blocks + block enumerates every draw of a run; a
    keyed bijection of it is the seed, so two draws never share one (see module docstring).
    """
    if not (0 <= noise_index < n_noise and 0 <= block < n_blocks and iteration >= 1):
        raise ValueError(f"noise index out of range: it={iteration} k={noise_index}/{n_noise} "
                         f"block={block}/{n_blocks}")
    counter = ((iteration - 1) * n_noise + noise_index) * n_blocks + block
    if counter > _M32:
        raise DeltalensError(f"iteration {iteration} x {n_noise} noise vectors x {n_blocks} blocks exceeds "
                             "2^32 distinct noise seeds; start a new run (new --seed) from the last checkpoint")
    return _mix32(counter, run_key(seed))


def member_noise(member: int, antithetic: bool) -> tuple[int, int]:
    """(noise index, sign) of a member: with antithetic pairs, members 2k and 2k+1 share ε_k with ±."""
    return (member // 2, -1 if member % 2 else 1) if antithetic else (member, 1)


def noise_coefficients(z: Sequence[float], n_noise: int, antithetic: bool) -> list[float]:
    """c_k = Σ_{members i using ε_k} sign_i z_i: the weight of noise vector k in the update (the
    same fold, in the same order, on every backend so their sums round identically)."""
    coeff = [0.0] * n_noise
    for i, zi in enumerate(z):
        k, sign = member_noise(i, antithetic)
        coeff[k] += sign * zi
    return coeff


def fitness_shaping(rewards: Sequence[float], method: str = "zscore") -> list[float]:
    """Shaped fitness z_i from member rewards R_i (float64 Python, deterministic).

    zscore: (R - mean) / std (population std; all zeros when every member scored the same).
    centered_rank: average rank of R_i among the N rewards, mapped to [-0.5, 0.5] (ties share a rank).
    """
    n = len(rewards)
    if method == "zscore":
        mean = sum(rewards) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
        return [0.0] * n if std < 1e-12 else [(r - mean) / std for r in rewards]
    if method == "centered_rank":
        order = sorted(range(n), key=lambda i: rewards[i])
        ranks = [0.0] * n
        i = 0
        while i < n:  # runs of equal rewards get their average rank
            j = i
            while j + 1 < n and rewards[order[j + 1]] == rewards[order[i]]:
                j += 1
            for m in range(i, j + 1):
                ranks[order[m]] = (i + j) / 2
            i = j + 1
        return [r / (n - 1) - 0.5 for r in ranks]
    raise DeltalensError(f"unknown fitness {method!r}; use one of zscore, centered_rank")


def iteration_problems(task, config, iteration: int):
    """The P training problems of `iteration`, drawn from an rng seeded by (seed, iteration): a resumed
    run or another replica gets the same prompts without any state."""
    rng = random.Random(f"deltalens-es-prompts/{config.seed}/{iteration}")
    return task.train(config.prompts_per_iteration, rng)


def draw_noise(seed: int, iteration: int, k: int, block: int, n_noise: int, n_blocks: int,
               out: torch.Tensor) -> torch.Tensor:
    """ε of (iteration, noise vector k, block): `out.numel()` fp32 N(0, 1) values written into `out`, from
    a CPU generator seeded by `noise_seed` (the same numbers on every device and backend)."""
    gen = torch.Generator().manual_seed(noise_seed(seed, iteration, k, block, n_noise, n_blocks))
    torch.randn(out.numel(), generator=gen, out=out)
    return out


def accumulate_noise(acc: torch.Tensor, coeff: Sequence[float], scale: float, noise) -> float:
    """acc ← scale · Σ_k coeff[k]·noise(k) in fp32, in k order, skipping zero coefficients (identically
    on every replica and backend, so their updates stay bit-identical). Returns seconds spent in noise()."""
    acc.zero_()
    noise_s = 0.0
    for k, c in enumerate(coeff):
        if c != 0.0:
            t0 = time.perf_counter()
            eps = noise(k)
            noise_s += time.perf_counter() - t0
            acc.add_(eps, alpha=c)
    acc.mul_(scale)
    return noise_s


def add_scaled(flat: torch.Tensor, x: torch.Tensor, s: float) -> None:
    """flat += s·x in fp32 arithmetic, rounded once to flat's dtype (every perturbation and update)."""
    if flat.dtype == torch.float32:
        flat.add_(x) if s == 1.0 else flat.add_(x, alpha=s)
    else:
        flat.copy_(flat.float().add_(x) if s == 1.0 else flat.float().add_(x, alpha=s))
