"""ES noise families and the one place their noise is applied (`Perturber`): θ + s·ε and Σ c_k ε_k.

A noise family says how the perturbation of one *block* (a tensor, or a CHUNK-sized piece of a larger
one, numbered over all parameters: `deltalens.training.es.strategy`) is made from (seed, iteration, noise
vector k, block), and how the update of a block is accumulated from the noise vectors' coefficients:

    family.draw(iteration, k, block, out)        ε_k of the block: out.numel() fp32 values, from a CPU
                                                 generator seeded by (seed, iteration, k, block)
    family.accumulate(acc, coeff, scale, noise)  acc = scale · Σ_k coeff_k · noise(k), fp32, in k order

A family may also take whole tensors and perturb them its own way (`bind`; low-rank noise takes the 2-D
ones: `deltalens.training.es.lowrank`); everything it does not take is cut into blocks and goes through
`draw`. Families are registered by name (`register`); `ESConfig.noise` picks one ("full": the Gaussian
ε of the paper; "lowrank"). A new family is one class with `draw`, registered: every path then uses it.

`Perturber` applies a family's noise to one replica's weights in any layout: a list of blocks, each a flat
view into the live weights (the HF model in `ESEngine`; vLLM's fused tensors in `FusedES`):

    shift(iteration, k, s)            θ ← θ + s·ε_k                   (perturb: s = ±σ; subtract-restore: ∓σ)
    update(iteration, coeff, scale)   θ ← θ + scale · Σ_k coeff_k ε_k (returns Σ of the squared update)
    members(iteration, users, row)    row(block, g) ← θ_block + s·ε_k per member row g (population batching)

`ReplicaES` is the one sequence of ES steps around a replica's `Perturber`, which `ESEngine` (the HF
model) and `FusedES` (vLLM's fused tensors) both run; they differ only in where the weights live:

    perturb(iteration, member, timing)   the base copy taken once (restore="copy"); θ ← θ + s·ε_k
    restore(iteration, member, timing)   the base copied back (exact), or θ ← θ - s·ε_k (restore="subtract")
    update(iteration, z)                 θ ← θ + (α/N) Σ_k c_k ε_k (`noise_coefficients`), base refreshed
    shift_of(member)                     (k, s): member i's noise vector and its ±σ (antithetic pairs share k)

A new noise family needs none of this: it is one `NoiseFamily` subclass.

Arithmetic (the same on every path, so replicas stay bit-identical): noise and sums in fp32 on the CPU,
added to the weights in fp32 and rounded once to the destination's dtype (`add_scaled`, `shifted_into`).
Blocks are independent work items: with a thread pool they run in parallel (torch releases the GIL),
with identical results; each thread keeps one noise and one accumulator buffer of at most a block.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from deltalens.errors import DeltalensError
from deltalens.training.es.strategy import (
    accumulate_noise,
    add_scaled,
    draw_noise,
    member_noise,
    noise_coefficients,
    noise_seed,
)

Block = tuple  # (owner key: a parameter position or name, flat view of the block, global block id)


def block_in(flat: torch.Tensor, param: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """The part of `dst` (a tensor shaped like `param`: a member row, a compute copy's tensor) that the block
    `flat`, a flat view of `param`, covers."""
    off = (flat.data_ptr() - param.data_ptr()) // param.element_size()
    return dst.view(-1)[off:off + flat.numel()]


class NoiseFamily:
    """How ε of a block is drawn and how a block's update is accumulated (see the module docstring).

    Subclasses set `name`, implement `draw`, and are registered with `register`. `options(config)` gives
    the constructor's extra keyword arguments from an ESConfig (plain data: they travel to other
    processes in `deltalens.training.es.backends.vllm.es_plan`).
    """

    name: ClassVar[str] = ""

    def __init__(self, seed: int, n_noise: int, n_blocks: int):
        self.seed, self.n_noise, self.n_blocks = seed, n_noise, n_blocks
        self.items: list = []  # the tensors this family perturbs as a whole (see `bind`); none by default

    @classmethod
    def options(cls, config) -> dict:
        return {}

    def seed_of(self, iteration: int, k: int, block: int) -> int:
        """The generator seed of (iteration, noise vector k, block): unique within a run (`noise_seed`)."""
        return noise_seed(self.seed, iteration, k, block, self.n_noise, self.n_blocks)

    def generator(self, iteration: int, k: int, block: int) -> torch.Generator:
        """A CPU generator seeded for (iteration, k, block): the same numbers on every device and backend."""
        return torch.Generator().manual_seed(self.seed_of(iteration, k, block))

    def draw(self, iteration: int, k: int, block: int, out: torch.Tensor) -> torch.Tensor:
        """Write ε_k of `block` (out.numel() fp32 values, mean 0, variance 1) into `out`; return it."""
        raise NotImplementedError

    def accumulate(self, acc: torch.Tensor, coeff: Sequence[float], scale: float,
                   noise: Callable[[int], torch.Tensor]) -> float:
        """acc ← scale · Σ_k coeff_k · noise(k) (fp32, k order, zero coefficients skipped identically on
        every replica); returns the seconds spent in noise()."""
        return accumulate_noise(acc, coeff, scale, noise)

    # -- whole-tensor noise (low rank); a dense family takes no tensor and these do nothing
    def bind(self, tensors: list[tuple[int, str, torch.Tensor, int]]) -> set[int]:
        """Take the tensors this family perturbs as a whole, from (position, name, tensor, first block
        id) of every trained tensor; returns the positions taken (their blocks skip `draw`)."""
        return set()

    def shift(self, iteration: int, k: int, s: float, timing: dict) -> None:
        """W ← W + s·E_k for every taken tensor."""

    def shift_into(self, iteration: int, k: int, s: float, dst_of: Callable[[torch.Tensor], torch.Tensor],
                   timing: dict) -> None:
        """dst_of(W) ← W + s·E_k for every taken tensor W, W itself untouched: the bits `shift` gives W,
        cast once to the destination's dtype. A family that takes tensors must override it."""
        if getattr(self, "items", None):
            raise NotImplementedError(f"noise family {self.name!r} takes tensors whole but has no shift_into")

    def update(self, iteration: int, coeff: Sequence[float], scale: float, timing: dict) -> float:
        """W ← W + scale · Σ_k coeff_k E_k for every taken tensor; returns Σ (update)²."""
        return 0.0

    def dense(self, iteration: int, k: int, j: int) -> torch.Tensor:
        """E_k of taken tensor j as a dense fp32 tensor (tests, analysis)."""
        raise DeltalensError(f"noise family {self.name!r} takes no tensor whole")

    def member_factors(self, iteration: int, users: dict[int, list[tuple[int, float]]],
                       count: int) -> dict[int, tuple[torch.Tensor, ...]]:
        """Per taken tensor j: what the population-batched forward adds for each of `count` member rows
        (users: noise vector k -> [(row g, s)], s = ±σ); see `deltalens.training.es.population`."""
        return {}


FAMILIES: dict[str, type[NoiseFamily]] = {}


def register(cls: type[NoiseFamily]) -> type[NoiseFamily]:
    """Register a noise family under `cls.name` (a class decorator); a name is registered once."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if FAMILIES.get(cls.name, cls) is not cls:
        raise ValueError(f"noise family {cls.name!r} is already registered ({FAMILIES[cls.name].__name__})")
    FAMILIES[cls.name] = cls
    return cls


def make_family(name: str, seed: int, n_noise: int, n_blocks: int, *, config=None,
                options: dict | None = None) -> NoiseFamily:
    """The registered family `name` for a run of (seed, n_noise vectors per iteration, n_blocks blocks);
    its options given, or taken from an ESConfig (`NoiseFamily.options`)."""
    if name not in FAMILIES:
        raise DeltalensError(f"unknown noise family {name!r}; use one of {', '.join(FAMILIES)}")
    cls = FAMILIES[name]
    if options is None:
        options = cls.options(config) if config is not None else {}
    return cls(seed, n_noise, n_blocks, **options)


@register
class GaussianNoise(NoiseFamily):
    """ε ~ N(0, I) per block (the paper's noise), drawn by `strategy.draw_noise`."""

    name = "full"

    def draw(self, iteration: int, k: int, block: int, out: torch.Tensor) -> torch.Tensor:
        return draw_noise(self.seed, iteration, k, block, self.n_noise, self.n_blocks, out)


def shifted_into(dst: torch.Tensor, src: torch.Tensor, x: torch.Tensor, s: float) -> None:
    """dst ← src + s·x in fp32 arithmetic, rounded once to dst's dtype (a member row of a stacked
    tensor: the very bits `add_scaled` gives src in place, then cast to dst's dtype)."""
    if dst.dtype == src.dtype:
        dst.copy_(src)
        add_scaled(dst, x, s)
    else:
        dst.copy_(src.float().add(x) if s == 1.0 else src.float().add(x, alpha=s))


def noise_pool(threads: int, n_weights: int, n_blocks: int, min_weights: int, prefix: str):
    """A thread pool of `threads` for the noise blocks, or None where one thread does: a single thread,
    a single block, or fewer than `min_weights` trained weights (too little work to share)."""
    if threads > 1 and n_blocks > 1 and n_weights >= min_weights:
        from concurrent.futures import ThreadPoolExecutor

        return ThreadPoolExecutor(threads, thread_name_prefix=prefix)
    return None


class Perturber:
    """A family's noise applied to one replica's weights (see the module docstring).

    blocks: (key, flat view, global block id) of every block the family draws (not the tensors it takes
    whole); `pool`: a thread pool for the blocks (`noise_pool`), or None; noise is drawn on the CPU and
    staged to the blocks' device through a per-thread buffer.
    """

    def __init__(self, family: NoiseFamily, blocks: list[Block], pool=None):
        self.family, self.blocks, self.pool = family, blocks, pool
        self.device = blocks[0][1].device if blocks else torch.device("cpu")
        self.max_block = max((b.numel() for _, b, _ in blocks), default=1)
        self._tls = threading.local()  # per-thread buffers: noise, acc (CPU), dev (the blocks' device)

    def close(self) -> None:
        """Shut the thread pool down (if any); the perturber then runs its blocks on the calling thread."""
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    # -- buffers and noise
    def buffer(self, name: str, numel: int, device: torch.device | None = None) -> torch.Tensor:
        """A per-thread fp32 buffer of at least `numel` elements (CPU unless `device`), first `numel` returned."""
        buf = getattr(self._tls, name, None)
        if buf is None or buf.numel() < numel:
            dev = device if device is not None else torch.device("cpu")
            pin = dev.type == "cpu" and self.device.type == "cuda"  # host side of the copies to the GPU
            buf = torch.empty(max(numel, self.max_block), device=dev, pin_memory=pin)
            setattr(self._tls, name, buf)
        return buf[:numel]

    def noise(self, iteration: int, k: int, block: int, numel: int) -> torch.Tensor:
        """ε_k of `block` (`numel` fp32 values) in this thread's noise buffer (CPU)."""
        return self.family.draw(iteration, k, block, self.buffer("noise", numel))

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """`host` on the blocks' device (itself on the CPU; else a blocking copy into a per-thread buffer)."""
        if self.device.type == "cpu":
            return host
        dev = self.buffer("dev", host.numel(), self.device)
        dev.copy_(host)  # blocking: the host buffer is free again when this returns
        return dev

    def map(self, fn, timing: dict, noise_key: str, other_key: str) -> list:
        """Run fn(block) -> (noise seconds, other seconds, value) over the blocks (pooled if enabled); the
        wall time is attributed to the two timing keys in proportion to the per-block seconds."""
        t0 = time.perf_counter()
        results = list(self.pool.map(fn, self.blocks)) if self.pool else [fn(b) for b in self.blocks]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t0
        noise = sum(r[0] for r in results)
        other = sum(r[1] for r in results)
        share = noise / (noise + other) if noise + other > 0 else 0.0
        timing[noise_key] = timing.get(noise_key, 0.0) + wall * share
        timing[other_key] = timing.get(other_key, 0.0) + wall * (1 - share)
        return [r[2] for r in results]

    # -- the ES operations
    @torch.no_grad()
    def shift(self, iteration: int, k: int, s: float, timing: dict) -> None:
        """θ ← θ + s·ε_k over every block and every tensor the family takes (fp32, rounded once).
        Timings: noise_s, perturb_restore_s."""
        def one(block):
            _, flat, b = block
            t0 = time.perf_counter()
            eps = self.noise(iteration, k, b, flat.numel())
            t1 = time.perf_counter()
            add_scaled(flat, self.to_device(eps), s)
            return t1 - t0, time.perf_counter() - t1, None

        self.map(one, timing, "noise_s", "perturb_restore_s")
        self.family.shift(iteration, k, s, timing)

    @torch.no_grad()
    def update(self, iteration: int, coeff: Sequence[float], scale: float, timing: dict) -> float:
        """θ ← θ + scale · Σ_k coeff_k ε_k: per block one pass over the noise vectors into an fp32
        accumulator (`family.accumulate`), added once; then the tensors the family takes. Returns
        Σ (update)² (float64, fixed block order). Timings: update_noise_s, update_apply_s."""
        def one(block):
            _, flat, b = block
            t_start = time.perf_counter()
            acc = self.buffer("acc", flat.numel())
            noise_s = self.family.accumulate(acc, coeff, scale, lambda k: self.noise(iteration, k, b, flat.numel()))
            sq = float(acc.double().square().sum())
            add_scaled(flat, self.to_device(acc), 1.0)
            return noise_s, time.perf_counter() - t_start - noise_s, sq

        sq = sum(self.map(one, timing, "update_noise_s", "update_apply_s"))
        return sq + self.family.update(iteration, coeff, scale, timing)

    @torch.no_grad()
    def members(self, iteration: int, users: dict[int, list[tuple[int, float]]],
                row: Callable[[Block, int], torch.Tensor], timing: dict) -> None:
        """For every block and every noise vector k: row(block, g) ← θ_block + s·ε_k for each (g, s) in
        users[k] (`shifted_into`: the bits `shift` gives θ, cast once to the row's dtype). Timings:
        noise_s, perturb_restore_s."""
        def one(block):
            _, flat, b = block
            noise_s = other_s = 0.0
            for k, rows in users.items():
                t1 = time.perf_counter()
                eps = self.to_device(self.noise(iteration, k, b, flat.numel()))
                t2 = time.perf_counter()
                for g, s in rows:
                    shifted_into(row(block, g), flat, eps, s)
                noise_s, other_s = noise_s + t2 - t1, other_s + time.perf_counter() - t2
            return noise_s, other_s, None

        self.map(one, timing, "noise_s", "perturb_restore_s")


class ReplicaES:
    """The ES steps of one weight replica around its `Perturber` (see the module docstring): `ESEngine`
    and `FusedES` both run these, so the local, Ray, population and vLLM paths perturb, restore and
    update by the same code.

    tensors: every trained tensor as a live view of the replica's weights (the tensors the family takes
    whole too): what the base copy of restore="copy" holds and what the update's RMS is over. sigma,
    alpha, population, antithetic, restore: the run's ES settings (`ESConfig`). The base copy is taken
    at the first perturbation and refreshed by every update; setting `base` to None (new weights loaded
    into the tensors) takes it again at the next perturbation.
    """

    def __init__(self, perturber: Perturber, tensors: Sequence[torch.Tensor], *, sigma: float, alpha: float,
                 population: int, antithetic: bool, restore: str):
        self.perturber, self.tensors = perturber, list(tensors)
        self.sigma, self.alpha, self.population = sigma, alpha, population
        self.antithetic, self.restore_mode = antithetic, restore
        self.n_trained = sum(t.numel() for t in self.tensors)
        self.device = self.tensors[0].device if self.tensors else torch.device("cpu")
        self.base: list[torch.Tensor] | None = None  # exact copies of `tensors` (restore="copy")

    def shift_of(self, member: int) -> tuple[int, float]:
        """(k, s): member `member` is θ + s·ε_k, s = ±σ (antithetic pairs share k with opposite signs)."""
        k, sign = member_noise(member, self.antithetic)
        return k, sign * self.sigma

    @torch.no_grad()
    def perturb(self, iteration: int, member: int, timing: dict) -> None:
        """θ ← θ + s·ε_k in place (the base copy first, once, for restore="copy"). Timings: noise_s,
        perturb_restore_s."""
        k, s = self.shift_of(member)
        if self.restore_mode == "copy" and self.base is None:
            self.base = [t.clone() for t in self.tensors]
        self.perturber.shift(iteration, k, s, timing)

    @torch.no_grad()
    def restore(self, iteration: int, member: int, timing: dict) -> None:
        """Undo `perturb`: copy the base back (exact), or subtract the regenerated noise (not bit-exact)."""
        if self.restore_mode == "copy":
            t0 = time.perf_counter()
            for t, b in zip(self.tensors, self.base):
                t.copy_(b)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            timing["perturb_restore_s"] = timing.get("perturb_restore_s", 0.0) + time.perf_counter() - t0
            return
        k, s = self.shift_of(member)
        self.perturber.shift(iteration, k, -s, timing)

    @torch.no_grad()
    def update(self, iteration: int, z: Sequence[float]) -> dict:
        """θ ← θ + (α/N) Σ_i z_i ε_i: the members' shaped rewards folded into one coefficient per noise
        vector (`noise_coefficients`), then `Perturber.update` (per block one fp32 accumulator, added
        once); the base copy follows the new weights. Returns update_s, update_noise_s and update_rms
        (the RMS of the update over the trained weights)."""
        coeff = noise_coefficients(z, self.perturber.family.n_noise, self.antithetic)
        timing = {"update_noise_s": 0.0, "update_apply_s": 0.0}
        t0 = time.perf_counter()
        sq = self.perturber.update(iteration, coeff, self.alpha / self.population, timing)
        if self.base is not None:
            for t, b in zip(self.tensors, self.base):
                b.copy_(t)
        return {"update_s": time.perf_counter() - t0, "update_noise_s": timing["update_noise_s"],
                "update_rms": math.sqrt(sq / max(self.n_trained, 1))}

    def close(self) -> None:
        """Shut the noise pool down and drop the base copy."""
        self.perturber.close()
        self.base = None
