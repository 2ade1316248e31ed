"""One ES model replica (`ESEngine`): perturb in place, score members, restore, apply updates.

The algorithm (Qiu et al., arXiv 2509.24372, in the setup arXiv 2608.27351 uses), one iteration t
(weights θ, population N, noise scale σ, step α):

    draw P training prompts from an rng seeded by (run seed, t)         shared by all members
    for member i = 0..N-1:
        θ_i = θ + σ ε_i,  ε_i ~ N(0, I)  (per block, regenerated from a seed, never stored)
        R_i = mean over the P prompts of reward(greedy completion of θ_i)  (one response per prompt)
    z = (R - mean R) / std R                                              z-scored rewards
    θ ← θ + (α / N) Σ_i z_i ε_i                                           α absorbs the 1/σ

Memory: the model is perturbed *in place* (no second model). One base copy of the trained tensors is
kept and copied back after each member (exact restore; `restore="subtract"` drops the copy and
subtracts the regenerated noise instead, which is not bit-exact: the reference script's way). Noise
lives one block (at most 4M elements) per thread at a time.

Where we depart from the paper / its reference code (seeds and arithmetic: `strategy`):
- Restore by copying a base copy back (bit-exact) instead of subtracting the regenerated noise.
- Update accumulated in fp32 over all members and rounded to the weight dtype once per iteration.
- `arithmetic="reference"` switches all three (noise layout, dtype, restore) to the reference script's
  (`reference`), for comparisons.
- Options the paper does not use: antithetic pairs (ε_{2k+1} = -ε_{2k}), centered-rank fitness
  shaping, a parameter filter (globs on names), low-rank noise (`lowrank`), population-batched
  evaluation (`population`), and a held-out greedy Pass@1 every `eval_every` iterations.

Tied weights (embedding = lm_head) are one tensor: parameters are deduplicated by storage pointer and
perturbed once, under the first name. Cost figures: docs/tuning.md (`benchmarks/bench_es.py`).
"""

from __future__ import annotations

import fnmatch
import math
import threading
import time
from collections.abc import Sequence

import torch

from deltalens.errors import DeltalensError
from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation.prompts import problem_prompts
from deltalens.io.models import weights_checksum  # defined in io.models (shared with GRPO)
from deltalens.training.es.config import ESConfig
from deltalens.training.es.lowrank import LowRankNoise
from deltalens.training.es.reference import ReferenceArithmetic
from deltalens.training.es.strategy import (
    CHUNK,
    accumulate_noise,
    add_scaled,
    draw_noise,
    iteration_problems,
    member_noise,
    noise_coefficients,
    noise_seed,
)

PARALLEL_MIN = 4_000_000  # use the noise thread pool only for models with at least this many trained weights


def _unique_params(model: torch.nn.Module) -> list[tuple[list[str], torch.nn.Parameter]]:
    """Parameters deduplicated by storage view (tied weights once), each with all of its names."""
    groups: dict[tuple, list] = {}  # storage view -> [names, tensor]
    for name, p in model.named_parameters(remove_duplicate=False):
        key = (p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape), p.stride(), p.dtype)
        groups.setdefault(key, [[], p])[0].append(name)
    return [(names, p) for names, p in groups.values()]


def select_params(model: torch.nn.Module, patterns: Sequence[str]) -> tuple[list[tuple[int, str, torch.Tensor]], int]:
    """Unique parameters (tied weights appear once, under their first name) matched by `patterns`, as
    (tensor index among all unique parameters, name, tensor); and the count of all unique parameters.

    Patterns are fnmatch globs applied in order; a leading "!" removes what it matches. A tied tensor is
    selected when any of its names is.
    """
    unique = _unique_params(model)
    chosen = []
    for index, (names, p) in enumerate(unique):
        keep = False
        for pat in patterns:
            neg = pat.startswith("!")
            if any(fnmatch.fnmatchcase(n, pat[1:] if neg else pat) for n in names):
                keep = not neg
        if keep:
            chosen.append((index, names[0], p))
    if not chosen:
        raise DeltalensError(f"--params {','.join(patterns)} matches no parameter; names look like "
                             f"{unique[0][0][0]!r}")
    return chosen, len(unique)


class ESEngine:
    """One model replica: perturb in place, score members, restore, apply updates.

    The local backend uses one engine; each Ray actor holds its own, and the driver holds one for
    updates, evaluation and checkpoints. Every method is deterministic given the weights, so replicas
    that start bit-identical stay bit-identical.

    Noise is drawn per *block*: each trained tensor's flattened elements cut into chunks of `CHUNK`
    (a tensor smaller than that is one block). Blocks are numbered over all unique parameters of the
    model (trained or not), and each (iteration, noise vector, block) has its own generator, so blocks
    are independent work items: with `noise_threads` > 1 they run in a thread pool (torch releases
    the GIL), with identical results, and noise buffers stay at CHUNK floats per thread.
    """

    def __init__(self, model, tokenizer, task, config: ESConfig):
        self.model, self.tok, self.task, self.config = model, tokenizer, task, config
        self.params, _ = select_params(model, config.params)
        self.n_noise = config.population // 2 if config.antithetic else config.population
        self.generator = HFBackend(model, tokenizer, chat_template=config.chat_template)
        self.max_new_tokens = config.max_new_tokens or task.max_new_tokens
        self.n_trained = sum(p.numel() for _, _, p in self.params)
        # blocks: (param position j, flat view of the block, global block id)
        self.chunk = CHUNK
        offsets, total = {}, 0  # first block id of each unique parameter (trained or not: filter-independent)
        for index, (_, p) in enumerate(_unique_params(model)):
            offsets[index] = total
            total += max(1, math.ceil(p.numel() / self.chunk))
        self.n_blocks = total
        self.blocks: list[tuple[int, torch.Tensor, int]] = []
        self.first_block: list[int] = []  # per trained tensor: its first block id (seeds its low-rank factors)
        for j, (index, name, p) in enumerate(self.params):
            if not p.is_contiguous():
                raise DeltalensError(f"parameter {name} is not contiguous; ES perturbs flat views in place")
            flat = p.detach().view(-1)
            self.first_block.append(offsets[index])
            for c in range(max(1, math.ceil(p.numel() / self.chunk))):
                self.blocks.append((j, flat[c * self.chunk:(c + 1) * self.chunk], offsets[index] + c))
        # low-rank noise (deltalens.training.es.lowrank) takes the 2-D tensors; dense ε stays on the others
        self.lowrank = None
        self.dense_blocks = self.blocks
        if config.noise == "lowrank":
            self.lowrank = LowRankNoise(self)
            self.dense_blocks = [blk for blk in self.blocks if self.params[blk[0]][2].dim() != 2]
        threads = config.noise_threads or torch.get_num_threads()
        self._pool = None
        if threads > 1 and self.n_trained >= PARALLEL_MIN and len(self.blocks) > 1:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="es-noise")
        self._tls = threading.local()  # per-thread fp32 buffers (noise, update accumulator)
        self._base: list[torch.Tensor] | None = None  # exact copies of the trained tensors (restore=copy)
        # arithmetic="reference": Qiu et al.'s script's noise layout and arithmetic (deltalens.training.es.reference)
        self.reference = ReferenceArithmetic(self) if config.arithmetic == "reference" else None
        self.member_buffers: dict[int, torch.Tensor] = {}  # population batching: stacked member tensors

    # -- noise
    def _buffer(self, name: str, numel: int) -> torch.Tensor:
        buf = getattr(self._tls, name, None)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, min(self.chunk, max(b.numel() for _, b, _ in self.blocks))))
            setattr(self._tls, name, buf)
        return buf[:numel]

    def _noise(self, iteration: int, k: int, block: int, numel: int) -> torch.Tensor:
        """ε of (iteration, noise vector k, block): `numel` fp32 N(0, 1) values in a per-thread buffer."""
        return draw_noise(self.config.seed, iteration, k, block, self.n_noise, self.n_blocks,
                          self._buffer("noise", numel))

    def noise_of(self, iteration: int, k: int, name: str) -> torch.Tensor:
        """The whole ε_k of one trained tensor (a fresh tensor; for tests and analysis); with low-rank
        noise, E_k = A Bᵀ / √r for 2-D tensors (what `perturb` adds, up to rounding)."""
        j = next(j for j, (_, n, _) in enumerate(self.params) if n == name)
        if self.lowrank is not None and self.params[j][2].dim() == 2:
            return self.lowrank.dense(iteration, k, j)
        parts = [self._noise(iteration, k, b, flat.numel()).clone() for jj, flat, b in self.blocks if jj == j]
        return torch.cat(parts).view(self.params[j][2].shape)

    def member_seeds(self, iteration: int) -> list[int]:
        """Per member: the seed of its first trained block (the others follow from the block counter)."""
        first = self.blocks[0][2]
        return [noise_seed(self.config.seed, iteration, member_noise(i, self.config.antithetic)[0], first,
                           self.n_noise, self.n_blocks) for i in range(self.config.population)]

    def _map_blocks(self, fn, timing: dict | None, noise_key: str, other_key: str) -> list:
        """Run fn(block) -> (noise seconds, other seconds, value) over all blocks (pooled if enabled);
        the wall time is attributed to the two timing keys in proportion to the per-block seconds."""
        t0 = time.perf_counter()
        blocks = self.dense_blocks
        results = list(self._pool.map(fn, blocks)) if self._pool else [fn(b) for b in blocks]
        wall = time.perf_counter() - t0
        if timing is not None:
            noise = sum(r[0] for r in results)
            other = sum(r[1] for r in results)
            share = noise / (noise + other) if noise + other > 0 else 0.0
            timing[noise_key] += wall * share
            timing[other_key] += wall * (1 - share)
        return [r[2] for r in results]

    def _shift(self, iteration: int, k: int, s: float, block) -> tuple[float, float, None]:
        """block += s·ε_k (fp32 arithmetic, rounded once to the weight dtype)."""
        _, flat, b = block
        t0 = time.perf_counter()
        eps = self._noise(iteration, k, b, flat.numel())
        t1 = time.perf_counter()
        add_scaled(flat, eps.to(flat.device), s)
        return t1 - t0, time.perf_counter() - t1, None

    def _shift_all(self, iteration: int, k: int, s: float, timing: dict) -> None:
        """θ += s·ε_k over every trained tensor (low-rank E_k on 2-D tensors when noise="lowrank")."""
        self._map_blocks(lambda blk: self._shift(iteration, k, s, blk), timing, "noise_s", "perturb_restore_s")
        if self.lowrank is not None:
            self.lowrank.shift(iteration, k, s, timing)

    # -- perturb / restore (timings accumulate into `timing`)
    @torch.no_grad()
    def perturb(self, iteration: int, member: int, timing: dict) -> None:
        """θ ← θ + sign·σ·ε_k in place."""
        if self.reference is not None:  # the reference script's layout and arithmetic (restore subtracts)
            self.reference.shift(iteration, member, self.config.sigma, timing)
            return
        k, sign = member_noise(member, self.config.antithetic)
        if self.config.restore == "copy" and self._base is None:
            self._base = [p.detach().clone() for _, _, p in self.params]
        self._shift_all(iteration, k, sign * self.config.sigma, timing)

    @torch.no_grad()
    def restore(self, iteration: int, member: int, timing: dict) -> None:
        """Undo `perturb`: copy the base back (exact), or subtract the regenerated noise (inexact)."""
        if self.config.restore == "copy":
            t0 = time.perf_counter()
            for (_, _, p), b in zip(self.params, self._base):
                p.copy_(b)
            timing["perturb_restore_s"] += time.perf_counter() - t0
            return
        if self.reference is not None:
            self.reference.shift(iteration, member, -self.config.sigma, timing)
            return
        k, sign = member_noise(member, self.config.antithetic)
        self._shift_all(iteration, k, -sign * self.config.sigma, timing)

    # -- rewards
    def sampling_params(self):
        return SamplingParams(n=1, temperature=self.config.temperature, max_new_tokens=self.max_new_tokens,
                              seed=self.config.seed)

    def mean_reward(self, completions: Sequence[str], problems) -> float:
        """Mean reward of one completion per problem."""
        return sum(self.task.score_problem(c, p) for c, p in zip(completions, problems)) / len(problems)

    def score(self, problems) -> float:
        """Mean reward of the current weights on `problems`: one response each (greedy by default)."""
        completions = self.generator.generate(problem_prompts(problems, self.generator.chat), self.sampling_params())
        return self.mean_reward([c[0] for c in completions], problems)

    def evaluate_members(self, iteration: int, members: Sequence[int], problems=None,
                         timing: dict | None = None) -> dict[int, float]:
        """Reward of each member, one after another: perturb, generate + score, restore.
        (`deltalens.training.es.population.evaluate_batched` evaluates several members per generation.)"""
        timing = timing if timing is not None else new_timing()
        problems = problems if problems is not None else iteration_problems(self.task, self.config, iteration)
        out = {}
        for m in members:
            self.perturb(iteration, m, timing)
            t0 = time.perf_counter()
            out[m] = self.score(problems)
            timing["generation_s"] += time.perf_counter() - t0
            self.restore(iteration, m, timing)
        return out

    # -- update
    @torch.no_grad()
    def update(self, iteration: int, z: Sequence[float]) -> dict:
        """θ ← θ + (α/N) Σ_i z_i ε_i: per block, one pass over the noise vectors into an fp32
        accumulator, rounded to the weight dtype once. Returns timings and the update's RMS."""
        cfg = self.config
        if self.reference is not None:
            return self.reference.update(iteration, z)
        coeff = noise_coefficients(z, self.n_noise, cfg.antithetic)
        scale = cfg.alpha / cfg.population

        def block_update(block):
            _, flat, b = block
            t_start = time.perf_counter()
            acc = self._buffer("acc", flat.numel())
            noise_s = accumulate_noise(acc, coeff, scale, lambda k: self._noise(iteration, k, b, flat.numel()))
            sq = float(acc.double().square().sum())
            add_scaled(flat, acc.to(flat.device), 1.0)
            return noise_s, time.perf_counter() - t_start - noise_s, sq

        timing = {"update_noise_s": 0.0, "update_apply_s": 0.0}
        t0 = time.perf_counter()
        sq = sum(self._map_blocks(block_update, timing, "update_noise_s", "update_apply_s"))  # fixed order
        if self.lowrank is not None:
            sq += self.lowrank.update(iteration, coeff, scale, timing)
        if self._base is not None:
            for (_, _, p), base in zip(self.params, self._base):
                base.copy_(p)
        return {"update_s": time.perf_counter() - t0, "update_noise_s": timing["update_noise_s"],
                "update_rms": math.sqrt(sq / max(self.n_trained, 1))}

    def checksum(self) -> str:
        return weights_checksum(self.model)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def new_timing() -> dict:
    return {"generation_s": 0.0, "noise_s": 0.0, "perturb_restore_s": 0.0}
