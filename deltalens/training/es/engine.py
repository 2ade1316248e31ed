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
lives one block (at most 4M elements) per thread at a time. With bf16 compute (`compute_dtype`) the
generator keeps one bf16 copy of the model (half the fp32 masters), refreshed from the perturbed master
once per member.

What ε is comes from the config's noise family (`deltalens.training.es.noise`: Gaussian "full",
"lowrank", or a registered one), applied through the same `Perturber` the population-batched and vLLM
paths use; perturb, restore and update are `noise.ReplicaES`, the steps `FusedES` (vLLM) runs too.

Where we depart from the paper / its reference code (seeds and arithmetic: `strategy`):
- Restore by copying a base copy back (bit-exact) instead of subtracting the regenerated noise.
- Update accumulated in fp32 over all members and rounded to the weight dtype once per iteration.
- `arithmetic="reference"` switches all three (noise layout, dtype, restore) to the reference script's
  (`reference`), for comparisons.
- Options the paper does not use: antithetic pairs (ε_{2k+1} = -ε_{2k}), centered-rank fitness
  shaping, a parameter filter (globs on names), low-rank noise (`lowrank`), population-batched
  evaluation (`population`), generation in bf16 from fp32 masters (`compute_dtype`), and a held-out
  greedy Pass@1 every `eval_every` iterations (in the compute dtype too).

Tied weights (embedding = lm_head) are one tensor: parameters are deduplicated by storage pointer and
perturbed once, under the first name. Cost figures: docs/tuning.md (`benchmarks/bench_es.py`).
"""

from __future__ import annotations

import fnmatch
import math
import time
from collections.abc import Sequence

import torch

from deltalens.errors import DeltalensError
from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation.dtype import master_dtype_params, model_compute_dtype
from deltalens.generation.prompts import problem_prompts
from deltalens.io.models import dtype_name, weights_checksum  # defined in io.models (shared with GRPO)
from deltalens.training.es import lowrank  # noqa: F401 - registers the "lowrank" noise family
from deltalens.training.es.config import ESConfig
from deltalens.training.es.noise import Perturber, ReplicaES, block_in, make_family, noise_pool
from deltalens.training.es.population import _key, _runner_params
from deltalens.training.es.reference import ReferenceArithmetic
from deltalens.training.es.strategy import CHUNK, iteration_problems, member_noise, noise_seed

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




def es_compute_dtype(config: ESConfig, model: torch.nn.Module, pinned: str | None = None) -> str:
    """The dtype members generate in ("fp32", "bf16", ...), the rule of `deltalens.generation.dtype`:
    weights loaded in bf16/fp16 generate as they are; fp32 weights in `config.compute_dtype`, auto = bf16
    where bf16 matmuls are fast (AMX-BF16 or AVX512-BF16 CPU, bf16 GPU) for hidden size >= 512, else fp32. `pinned`: what
    the run resolved when it started (a resume, a Ray replica), so auto cannot change mid-run. The vLLM
    backend generates in the weight dtype (vLLM computes in the dtype it loads)."""
    param = next(model.parameters())
    if param.dtype != torch.float32 or config.backend == "vllm":
        return dtype_name(param.dtype)
    if pinned is not None:
        return pinned
    name = dtype_name(model_compute_dtype(config.compute_dtype, model))
    if name == "bf16" and config.compute_dtype == "auto" and coarse_tensor(model, config) is not None:
        return "fp32"  # auto means "fast where exact enough": σ would drown in bf16's rounding here
    return name


BF16_HALF_STEP = 2.0 ** -8  # bf16 keeps 8 significant bits: half a step is |w|·2^-9 .. |w|·2^-8


def coarse_tensor(model: torch.nn.Module, config: ESConfig) -> tuple[str, float] | None:
    """The first perturbed tensor a bf16 compute copy rounds to bf16 whose median |w| is so large that σ is
    under half a bf16 step there (σ < median|w| · 2^-8), as (name, median |w|); None when σ survives bf16
    rounding in every such tensor.

    Why: a member generated from bf16(θ + σε) sees σε only where it crosses a rounding boundary, the same
    boundary for every token. The norm layers' weights, the tensors of ~1-2 where this bites (SmolLM2's
    final norm, median 1.78; Qwen2.5's, ~2; Gemma's 1 + w) and the ones claim 4 is about, stay fp32 in the
    compute copy, as do Linear biases (Qwen2.5's q_proj biases, median ~1.5)
    (`deltalens.generation.dtype.master_dtype_params`), and are not checked; a matrix this
    coarse would still drown σ, and `compute_dtype: auto` then stays fp32; an explicit bf16 is obeyed.
    The median is taken over at most 2^20 strided elements.
    """
    params, _ = select_params(model, config.params)
    kept = master_dtype_params(model)
    for _, name, p in params:
        if name in kept:
            continue
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // (1 << 20))
        med = float(flat[::step].abs().float().median())
        if config.sigma < med * BF16_HALF_STEP:
            return name, med
    return None


class ESEngine:
    """One model replica: perturb in place, score members, restore, apply updates.

    The local backend uses one engine; each Ray actor holds its own, and the driver holds one for
    updates, evaluation and checkpoints. Every method is deterministic given the weights, so replicas
    that start bit-identical stay bit-identical.

    Noise is drawn per *block*: each trained tensor's flattened elements cut into chunks of `CHUNK`
    (a tensor smaller than that is one block). Blocks are numbered over all unique parameters of the
    model (trained or not), and each (iteration, noise vector, block) has its own generator, so blocks
    are independent work items: with `noise_threads` > 1 they run in a thread pool (torch releases
    the GIL), with identical results, and noise buffers stay at CHUNK floats per thread. The noise
    itself is the config's noise family (`deltalens.training.es.noise`), applied by a `Perturber`.

    Compute dtype (`es_compute_dtype`; `compute_dtype` holds the resolved name): the fp32 master weights
    are updated as always; with bf16 compute `evaluate_members` writes each member, fp32 θ + s·ε cast once,
    into the generator's bf16 copy (`HFBackend`'s compute copy; its norm layers' weights stay fp32,
    `deltalens.generation.dtype`) and never perturbs the master, so there is nothing to restore (`restore`
    then has no effect: subtract cannot drift) and the update stays fp32. `perturb` / `restore` still work
    on the master for the tools that call them (diversity). `compute_dtype` given: use it (a resume or a
    replica pins what its run resolved).
    """

    def __init__(self, model, tokenizer, task, config: ESConfig, compute_dtype: str | None = None):
        self.model, self.tok, self.task, self.config = model, tokenizer, task, config
        self.params, _ = select_params(model, config.params)
        self.n_noise = config.population // 2 if config.antithetic else config.population
        self.compute_dtype = es_compute_dtype(config, model, compute_dtype)
        # (weights loaded in bf16/fp16 generate as they are, whatever HFBackend's compute dtype says)
        self.generator = HFBackend(model, tokenizer, chat_template=config.chat_template,
                                   compute_dtype="bf16" if self.compute_dtype == "bf16" else "fp32")
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
        # the noise family (config.noise); a family may take whole tensors (low rank: the 2-D ones), the
        # blocks of the others are drawn block by block
        self.family = make_family(config.noise, config.seed, self.n_noise, self.n_blocks, config=config)
        taken = self.family.bind([(j, name, p, self.first_block[j]) for j, (_, name, p) in enumerate(self.params)])
        self.dense_blocks = [blk for blk in self.blocks if blk[0] not in taken]
        self.lowrank = self.family if taken else None  # the family's whole-tensor part (items, factors)
        pool = noise_pool(config.noise_threads or torch.get_num_threads(), self.n_trained, len(self.blocks),
                          PARALLEL_MIN, "es-noise")
        self.perturber = Perturber(self.family, self.dense_blocks, pool)
        # perturb / restore / update: the steps every path shares (the base copy of restore=copy lives there)
        self.es = ReplicaES(self.perturber, [p.detach() for _, _, p in self.params], sigma=config.sigma,
                            alpha=config.alpha, population=config.population, antithetic=config.antithetic,
                            restore=config.restore)
        # arithmetic="reference": Qiu et al.'s script's noise layout and arithmetic (deltalens.training.es.reference)
        self.reference = ReferenceArithmetic(self) if config.arithmetic == "reference" else None
        self.member_buffers: dict[int, torch.Tensor] = {}  # population batching: stacked member tensors

    @property
    def _pool(self):
        return self.perturber.pool

    @property
    def _base(self) -> list[torch.Tensor] | None:
        """The exact copies of the trained tensors (restore=copy); None: taken at the next perturbation
        (set it to None after loading new weights into the model)."""
        return self.es.base

    @_base.setter
    def _base(self, base: list[torch.Tensor] | None) -> None:
        self.es.base = base

    # -- noise
    def _noise(self, iteration: int, k: int, block: int, numel: int) -> torch.Tensor:
        """ε of (iteration, noise vector k, block): `numel` fp32 values in a per-thread buffer."""
        return self.perturber.noise(iteration, k, block, numel)

    def noise_of(self, iteration: int, k: int, name: str) -> torch.Tensor:
        """The whole ε_k of one trained tensor (a fresh tensor; for tests and analysis); with low-rank
        noise, E_k = A Bᵀ / √r for 2-D tensors (what `perturb` adds, up to rounding)."""
        j = next(j for j, (_, n, _) in enumerate(self.params) if n == name)
        if any(item[0] == j for item in self.family.items):
            return self.family.dense(iteration, k, j)
        parts = [self._noise(iteration, k, b, flat.numel()).clone() for jj, flat, b in self.blocks if jj == j]
        return torch.cat(parts).view(self.params[j][2].shape)

    def member_seeds(self, iteration: int) -> list[int]:
        """Per member: the seed of its first trained block (the others follow from the block counter)."""
        first = self.blocks[0][2]
        return [noise_seed(self.config.seed, iteration, member_noise(i, self.config.antithetic)[0], first,
                           self.n_noise, self.n_blocks) for i in range(self.config.population)]

    def compute_model(self) -> torch.nn.Module:
        """The module members generate on: the master itself, or the generator's compute copy refreshed
        from the master (one cast; population batching runs its member forwards on it)."""
        return self.generator.runner()

    # -- perturb / restore (timings accumulate into `timing`)
    @torch.no_grad()
    def perturb(self, iteration: int, member: int, timing: dict) -> None:
        """θ ← θ + sign·σ·ε_k in place (`ReplicaES.perturb`)."""
        if self.reference is not None:  # the reference script's layout and arithmetic (restore subtracts)
            self.reference.shift(iteration, member, self.config.sigma, timing)
            return
        self.es.perturb(iteration, member, timing)

    @torch.no_grad()
    def restore(self, iteration: int, member: int, timing: dict) -> None:
        """Undo `perturb`: copy the base back (exact), or subtract the regenerated noise (inexact)."""
        if self.reference is not None and self.config.restore != "copy":
            self.reference.shift(iteration, member, -self.config.sigma, timing)
            return
        self.es.restore(iteration, member, timing)

    # -- rewards
    def sampling_params(self):
        return SamplingParams(n=1, temperature=self.config.temperature, max_new_tokens=self.max_new_tokens,
                              seed=self.config.seed, stop=self.task.stop_strings(self.generator.chat))

    def mean_reward(self, completions: Sequence[str], problems, timing: dict | None = None) -> float:
        """Mean reward of one completion per problem; counts the completions' tokens into `timing` (the
        measured lengths FLOP accounting uses: deltalens.study.flops)."""
        if timing is not None:
            tokens = sum(len(self.tok(c, add_special_tokens=False).input_ids) for c in completions)
            timing["completion_tokens"] = timing.get("completion_tokens", 0) + tokens
            timing["completions"] = timing.get("completions", 0) + len(completions)
        return sum(self.task.score_problem(c, p) for c, p in zip(completions, problems)) / len(problems)

    def score(self, problems, timing: dict | None = None) -> float:
        """Mean reward of the current weights on `problems`: one response each (greedy by default)."""
        completions = self.generator.generate(problem_prompts(problems, self.generator.chat), self.sampling_params())
        return self.mean_reward([c[0] for c in completions], problems, timing)

    def evaluate_members(self, iteration: int, members: Sequence[int], problems=None,
                         timing: dict | None = None) -> dict[int, float]:
        """Reward of each member, one after another: perturb, generate + score, restore; with a compute copy
        of another dtype, each member written into the copy instead (`_evaluate_in_copy`).
        (`deltalens.training.es.population.evaluate_batched` evaluates several members per generation.)"""
        timing = timing if timing is not None else new_timing()
        problems = problems if problems is not None else iteration_problems(self.task, self.config, iteration)
        if self._members_in_copy():
            return self._evaluate_in_copy(iteration, members, problems, timing)
        out = {}
        for m in members:
            self.perturb(iteration, m, timing)
            t0 = time.perf_counter()
            out[m] = self.score(problems, timing)
            timing["generation_s"] += time.perf_counter() - t0
            self.restore(iteration, m, timing)
        return out

    def _members_in_copy(self) -> bool:
        """Whether members are written straight into a compute copy of another dtype (bf16 compute on fp32
        masters, our arithmetic): the master is then never perturbed, so nothing is restored and no base
        copy of the weights is taken (SmolLM2: 538 MB less; Qwen2.5-1.5B: ~7 GB)."""
        master = next(self.model.parameters()).dtype
        return (self.reference is None and isinstance(self.generator, HFBackend)
                and self.generator.dtype != master)

    @torch.no_grad()
    def _evaluate_in_copy(self, iteration: int, members: Sequence[int], problems, timing: dict) -> dict[int, float]:
        """`evaluate_members` with each member written into the generator's compute copy: its trained
        tensors ← the master's + s·ε_k in fp32, cast once (`Perturber.members`, `shift_into`: the bits a
        perturbed master cast into the copy has, so rewards equal the perturb-and-restore path's), the rest
        of the copy refreshed from the master once per call. The copy keeps the last member afterwards:
        every later `generate` outside `as_is` refreshes it from the master first (`HFBackend.runner`)."""
        t0 = time.perf_counter()
        runner = self.generator.runner()  # created, or refreshed from the master (untrained tensors too)
        if runner is self.model:  # never write members into the master here: nothing would restore it
            raise DeltalensError("internal: members in the compute copy, but the generator runs the master")
        timing["generation_s"] += time.perf_counter() - t0  # the cast, as `generate`'s own refresh counts
        targets = _runner_params(self, runner)  # master tensor -> the copy's (as population batching pairs them)

        def into(p: torch.Tensor) -> torch.Tensor:
            return targets[_key(p)][0]

        def row(block, _g):  # the compute copy's part of one noise block
            j, flat, _ = block
            p = self.params[j][2]
            return block_in(flat, p, into(p))

        out = {}
        with self.generator.as_is():
            for m in members:
                k, s = self.es.shift_of(m)
                self.perturber.members(iteration, {k: [(0, s)]}, row, timing)
                self.family.shift_into(iteration, k, s, into, timing)
                t0 = time.perf_counter()
                out[m] = self.score(problems, timing)
                timing["generation_s"] += time.perf_counter() - t0
        return out

    # -- update
    @torch.no_grad()
    def update(self, iteration: int, z: Sequence[float]) -> dict:
        """θ ← θ + (α/N) Σ_i z_i ε_i (`ReplicaES.update`: per block one fp32 accumulator over the noise
        vectors, rounded to the weight dtype once). Returns timings and the update's RMS."""
        if self.reference is not None:
            return self.reference.update(iteration, z)
        return self.es.update(iteration, z)

    def checksum(self) -> str:
        return weights_checksum(self.model)

    def close(self) -> None:
        self.perturber.close()


def new_timing() -> dict:
    # completion_tokens / completions: summed over members (and Ray workers); the row's completion_length
    return {"generation_s": 0.0, "noise_s": 0.0, "perturb_restore_s": 0.0, "completion_tokens": 0, "completions": 0}
