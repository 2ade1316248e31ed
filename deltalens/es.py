"""Evolution Strategies fine-tuning: seeded in-place population search over the full parameter vector.

The algorithm is the one of Qiu et al., "Evolution Strategies at Scale: LLM Fine-Tuning Beyond
Reinforcement Learning" (arXiv 2509.24372), in the setup that arXiv 2608.27351 uses to compare what ES
and GRPO change in the weights. One iteration t (weights θ, population N, noise scale σ, step α):

    draw P training prompts from an rng seeded by (run seed, t)         shared by all members
    for member i = 0..N-1:
        θ_i = θ + σ ε_i,  ε_i ~ N(0, I)  (per tensor, regenerated from a seed, never stored)
        R_i = mean over the P prompts of reward(greedy completion of θ_i)  (one response per prompt)
    z = (R - mean R) / std R                                              z-scored rewards
    θ ← θ + (α / N) Σ_i z_i ε_i                                           α absorbs the 1/σ

Defaults are the paper's: N = 32, σ = 1.5e-3, α = 2.5e-4, P = 64, greedy decoding (temperature 0).

Memory: the model is perturbed *in place* (no second model). One base copy of the trained tensors is
kept and copied back after each member (exact restore; `restore="subtract"` drops the copy and
subtracts the regenerated noise instead, which is not bit-exact). Noise lives one block (at most
4M elements) per thread at a time.

ES state vs hyperparameters (evosax OpenES style): the state is (run seed, step) plus the weights
themselves; every ε is a function of (seed, step, member, block) and is regenerated when needed, so
a checkpoint of the weights + step resumes a run exactly, and any replica holding the same weights
can apply an update from (seeds, z) alone (the Ray backend, `deltalens.es_ray`, relies on this).

Where we depart from the paper / its reference code
- Noise seeds. Reference code seeds one generator per member and walks the tensors in order. We seed
  each (step, member, block) separately, where a block is a tensor or a 4M-element chunk of a larger
  one, numbered over all parameters of the model. So the noise of a tensor does not depend on which
  other tensors are trained (`params` filter), blocks can be drawn in parallel threads with identical
  results, and noise buffers stay small. The seed is a keyed bijection of the counter
  ((step-1)·K + noise index)·B + block (K noise vectors per step, B blocks), not a 63-bit hash of
  names: torch's CPU generator (mt19937) keeps only the low 32 bits of a seed (`manual_seed(1)` and
  `manual_seed(1 + 2**32)` give the same stream), and 32-bit hashes collide by the birthday bound
  (~1000 colliding pairs in a 500-step run of a 200-tensor model). A bijection of a counter cannot
  collide: within a run no two (step, member, block) share noise.
- Restore by copying a base copy back (bit-exact) instead of subtracting the regenerated noise.
- Update accumulated in fp32 over all members and rounded to the weight dtype once per iteration
  (reference code adds each member's contribution in the model dtype).
- Options the paper does not use: antithetic pairs (ε_{2k+1} = -ε_{2k}), centered-rank fitness
  shaping (evosax `centered_rank`: ranks mapped to [-0.5, 0.5], ties averaged), a parameter filter
  (globs on names), and a small held-out Pass@1 (greedy) evaluation every `eval_every` iterations.

Throughput options (both off by default; the defaults reproduce the paper's loop):
- `noise="lowrank", rank=r`: EGGROLL-style rank-r noise E = A·Bᵀ/√r on 2-D weights, dense ε on the
  rest; the update is one matmul per tensor (`deltalens.es_lowrank`).
- `population_batch=G`: G members generate together in batched `generate` calls, with member-aware
  Linear/Embedding/RMSNorm forwards (`deltalens.es_population`): full-rank members from stacked
  perturbed weights (same responses as this loop on CPU, see that module), low-rank members over the
  shared weights (never materialised).
Both run on the local backend only; `noise`, `rank` and `population_batch` are stored in the run
config (trajectory fields: a resume keeps them) and old configs load with the defaults.

Tied weights (embedding = lm_head) are one tensor: parameters are deduplicated by storage pointer and
perturbed once, under the first name.

Cost: each member needs one noise draw per trained weight (N draws per iteration) and the update
regenerates them (N more; N/2 with antithetic pairs), accumulated per block in one pass over the
noise vectors (an fp32 accumulator and a noise buffer of one block per thread). torch draws
~150-200M normals/s per core, so SmolLM2-135M costs ~0.7 s of noise per member and as much again in
the update, ~5% of an iteration at 32 prompts and 1 thread (12% at 8 prompts; generation grows with
the prompts, noise does not). `benchmarks/bench_es.py` measures the split.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from deltalens.errors import DeltalensError

# ----------------------------------------------------------------------------------------------
# configuration


@dataclass
class ESConfig:
    """Hyperparameters of an ES run (one help line per field; defaults are the paper's).

    Presets: `ESConfig.preset("tiny", **overrides)` for the bundled 0.76M-parameter tiny model. Its
    σ and α were chosen by held-out greedy Pass@1 (not training reward) in short CPU runs from the
    tiny model, see `PRESETS`.
    """

    model: str = "tiny"  # model spec (see deltalens.models.load_model): tiny, HF dir, run dir, .gguf, hub id
    task: str = "arith"  # task name (deltalens.tasks.get_task)
    data: str | None = None  # jsonl file/directory for the gsm8k and jsonl tasks
    question_field: str = "question"  # jsonl task: question field
    answer_field: str = "answer"  # jsonl task: answer field
    population: int = 32  # N: members per iteration (each a full-model perturbation)
    sigma: float = 1.5e-3  # σ: noise scale, θ_i = θ + σ ε_i with ε_i ~ N(0, I)
    alpha: float = 2.5e-4  # α: step, θ += (α/N) Σ z_i ε_i (α absorbs 1/σ, as in the paper)
    prompts_per_iteration: int = 64  # P: training prompts per iteration, shared by all members
    temperature: float = 0.0  # training decoding temperature (0 = greedy, the paper's setting)
    max_new_tokens: int | None = None  # generation budget per response (None: the task's)
    antithetic: bool = False  # mirrored pairs: member 2k+1 uses -ε of member 2k (population must be even)
    fitness: str = "zscore"  # reward shaping: zscore (paper) or centered_rank (evosax style)
    params: tuple[str, ...] = ("*",)  # globs on parameter names to train; "!glob" excludes (applied in order)
    dtype: str = "fp32"  # weight dtype: fp32, bf16, fp16 (update accumulated in fp32, rounded once)
    restore: str = "copy"  # restore after each member: copy (exact, one base copy) or subtract (no copy, inexact)
    iterations: int = 100  # number of ES iterations (updates)
    eval_every: int = 10  # held-out greedy Pass@1 every k iterations and at the end (0 = never)
    eval_limit: int = 64  # number of held-out test problems in that evaluation
    checkpoint_every: int = 10  # HF checkpoint every k iterations (resume points; 0 = only the final one)
    seed: int = 0  # run seed: prompts and noise are functions of (seed, iteration, member, block)
    backend: str = "local"  # where members are evaluated: local (in-process), ray (actors), vllm (GPU engine)
    noise_threads: int = 0  # threads drawing noise blocks in parallel (0 = torch's thread count; same results)
    workers: int = 2  # ray backend: number of actors (each holds a model replica)
    threads_per_worker: int = 1  # ray backend: torch threads per actor
    save_pt: bool = False  # also write a plain state dict (.pt) beside each checkpoint
    noise: str = "full"  # full (dense ε per tensor) or lowrank (EGGROLL: rank-r A·Bᵀ/√r on 2-D weights, dense ε on 1-D)
    rank: int = 1  # lowrank noise: rank r of each 2-D perturbation
    population_batch: int = 0  # members per batched generation (deltalens.es_population); 0 or 1: one by one
    device: str = "cpu"  # local backend: where the model runs (cpu, cuda, cuda:N, auto); noise is drawn on the CPU

    # fields that decide the trajectory: a resumed run must keep them (the others may change)
    TRAJECTORY = ("model", "task", "data", "question_field", "answer_field", "population", "sigma", "alpha",
                  "prompts_per_iteration", "temperature", "max_new_tokens", "antithetic", "fitness",
                  "params", "dtype", "restore", "seed", "noise", "rank", "population_batch")

    def __post_init__(self):
        if isinstance(self.params, str):
            self.params = tuple(p.strip() for p in self.params.split(",") if p.strip())
        self.params = tuple(self.params)
        checks = [
            (self.population >= 2, f"population must be >= 2 (got {self.population}); set --population"),
            (not self.antithetic or self.population % 2 == 0,
             (f"antithetic pairs need an even population (got {self.population}); set --population to an "
              "even number or drop --antithetic")),
            (self.sigma > 0 and math.isfinite(self.sigma), f"sigma must be > 0 (got {self.sigma}); set --sigma"),
            (self.alpha > 0 and math.isfinite(self.alpha), f"alpha must be > 0 (got {self.alpha}); set --alpha"),
            (self.prompts_per_iteration >= 1,
             f"prompts_per_iteration must be >= 1 (got {self.prompts_per_iteration}); set --prompts"),
            (self.temperature >= 0, f"temperature must be >= 0 (got {self.temperature}); 0 is greedy"),
            (self.max_new_tokens is None or self.max_new_tokens >= 1,
             f"max_new_tokens must be >= 1 (got {self.max_new_tokens}); set --max-new-tokens"),
            (self.fitness in FITNESS, f"unknown fitness {self.fitness!r}; use one of {', '.join(FITNESS)}"),
            (bool(self.params), "params is empty; give at least one glob, e.g. --params '*'"),
            (self.dtype in ("fp32", "bf16", "fp16"), f"dtype must be fp32, bf16 or fp16 (got {self.dtype!r})"),
            (self.restore in ("copy", "subtract"), f"restore must be copy or subtract (got {self.restore!r})"),
            (self.iterations >= 1, f"iterations must be >= 1 (got {self.iterations}); set --iterations"),
            (self.eval_every >= 0, f"eval_every must be >= 0 (got {self.eval_every}); 0 disables evaluation"),
            (self.eval_limit >= 1, f"eval_limit must be >= 1 (got {self.eval_limit}); set --eval-limit"),
            (self.checkpoint_every >= 0,
             f"checkpoint_every must be >= 0 (got {self.checkpoint_every}); 0 saves only the final weights"),
            (self.backend in ("local", "ray", "vllm"),
             f"backend must be local, ray or vllm (got {self.backend!r})"),
            (self.noise_threads >= 0, f"noise_threads must be >= 0 (got {self.noise_threads}); 0 = auto"),
            (self.workers >= 1, f"workers must be >= 1 (got {self.workers}); set --workers"),
            (self.threads_per_worker >= 1, f"threads_per_worker must be >= 1 (got {self.threads_per_worker})"),
            (self.noise in NOISE, f"noise must be full or lowrank (got {self.noise!r}); set --noise"),
            (self.rank >= 1, f"rank must be >= 1 (got {self.rank}); set --rank"),
            (self.rank == 1 or self.noise == "lowrank",
             f"--rank {self.rank} needs --noise lowrank (full-rank noise has no rank); add --noise lowrank"),
            (self.population_batch >= 0,
             f"population_batch must be >= 0 (got {self.population_batch}); 0 evaluates members one by one"),
            (self.population_batch <= self.population,
             (f"population_batch {self.population_batch} exceeds the population {self.population}; set "
              f"--population-batch {self.population} or less")),
            (self.device in ("cpu", "cuda", "auto") or (self.device.startswith("cuda:") and self.device[5:].isdigit()),
             f"device must be cpu, cuda, cuda:N or auto (got {self.device!r}); set --device"),
            (self.device == "cpu" or self.backend == "local",
             f"--device {self.device} is for the local backend; ray and vllm place their own models"),
            (self.backend == "local" or (self.noise == "full" and self.population_batch <= 1),
             (f"--backend {self.backend} supports only full-rank noise evaluated member by member; use "
              "--backend local for --noise lowrank or --population-batch (or drop those options)")),
        ]
        for ok, message in checks:
            if not ok:
                raise DeltalensError(message)

    @classmethod
    def preset(cls, name: str, **overrides) -> ESConfig:
        """A named preset (`paper` = the defaults, `tiny` = for the bundled tiny model) plus overrides."""
        if name not in PRESETS:
            raise DeltalensError(f"unknown ES preset {name!r}; use one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, d: dict) -> ESConfig:
        """Rebuild from a run's config.json (ignores the run-level keys `method` and `deltalens_version`)."""
        if d.get("method", "es") != "es":
            raise DeltalensError(f"this run was made with --method {d['method']}; resume it with that method")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names - {"method", "deltalens_version"})
        if unknown:
            raise DeltalensError(f"config has unknown ES fields {unknown}; was it written by another method?")
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        return {"method": "es", **asdict(self), "params": list(self.params)}


FITNESS = ("zscore", "centered_rank")
NOISE = ("full", "lowrank")

# `tiny`: for the 0.76M-parameter bundled model (weight RMS ~0.035 in its matrices), chosen with
# held-out data, not training reward. (1) Signal check: 16 members scored on two disjoint sets of 64
# training prompts; the correlation of member rewards across the two sets says how much of the
# fitness is a property of the perturbation rather than of the prompts. Plain members: 0.08 / 0.11 /
# 0.54 / 0.70 at σ = 1.5e-3 / 3e-3 / 6e-3 / 1.2e-2, but most of that at large σ is the second-order
# "damage" term (symmetric in ±ε, no use for the update; members lost 30% reward at 1.2e-2). Antithetic
# pair differences cancel it: 0.14 / 0.33 / 0.63 at σ = 3e-3 / 6e-3 / 1.2e-2. Hence antithetic pairs
# and σ = 6e-3 (members keep ~96% of the base reward). (2) α from 15-20-iteration runs (N=32, P=64)
# scored by greedy Pass@1 on held-out test problems: σ=3e-3 with α=1.5e-3 or 3e-3 (no pairs)
# 0.17 -> 0.145 (earlier base snapshot); with pairs σ=6e-3/α=3e-3 0.32 -> 0.335, σ=1e-2/α=5e-3
# 0.32 -> 0.325, σ=6e-3/α=1e-2 0.31 -> 0.30: within evaluation noise (±0.02) at 20 iterations, and
# α = 1e-2 was the only one to end lower. (3) The preset over 60 iterations (10 CPU-minutes):
# greedy Pass@1 on 500 test problems 0.310 -> 0.312 / 0.350 / 0.358 / 0.364 / 0.364 / 0.378 at
# iterations 0/10/20/30/40/50/60; greedy reward on 512 fixed training prompts 0.390 -> 0.476.
PRESETS: dict[str, dict] = {
    "paper": {},
    "tiny": {"sigma": 6e-3, "alpha": 3e-3, "antithetic": True, "population": 32, "prompts_per_iteration": 64,
             "eval_every": 10, "eval_limit": 200, "checkpoint_every": 10},
}


# ----------------------------------------------------------------------------------------------
# noise: seeds, member layout


_M32 = 0xFFFFFFFF
CHUNK = 1 << 22  # noise block: at most 4M elements (16 MiB fp32) of one tensor share a generator
PARALLEL_MIN = 4_000_000  # use the noise thread pool only for models with at least this many trained weights


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
    raise DeltalensError(f"unknown fitness {method!r}; use one of {', '.join(FITNESS)}")


def iteration_problems(task, config: ESConfig, iteration: int):
    """The P training problems of `iteration`, drawn from an rng seeded by (seed, iteration): a resumed
    run or another replica gets the same prompts without any state."""
    rng = random.Random(f"deltalens-es-prompts/{config.seed}/{iteration}")
    return task.train(config.prompts_per_iteration, rng)


def make_task(config: ESConfig):
    from deltalens.tasks import get_task

    return get_task(config.task, data=config.data, question_field=config.question_field,
                    answer_field=config.answer_field)


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


def weights_checksum(model: torch.nn.Module) -> str:
    """blake2b of every unique parameter's bytes (in order): equal checksums = bit-identical weights."""
    h = hashlib.blake2b(digest_size=16)
    seen = set()
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        h.update(name.encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# one model replica


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
        from deltalens.generation import HFBackend

        self.model, self.tok, self.task, self.config = model, tokenizer, task, config
        self.params, _ = select_params(model, config.params)
        self.n_noise = config.population // 2 if config.antithetic else config.population
        self.generator = HFBackend(model, tokenizer)
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
        # low-rank noise (deltalens.es_lowrank) takes the 2-D tensors; dense ε stays on the others
        self.lowrank = None
        self.dense_blocks = self.blocks
        if config.noise == "lowrank":
            from deltalens.es_lowrank import LowRankNoise

            self.lowrank = LowRankNoise(self)
            self.dense_blocks = [blk for blk in self.blocks if self.params[blk[0]][2].dim() != 2]
        threads = config.noise_threads or torch.get_num_threads()
        self._pool = None
        if threads > 1 and self.n_trained >= PARALLEL_MIN and len(self.blocks) > 1:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="es-noise")
        self._tls = threading.local()  # per-thread fp32 buffers (noise, update accumulator)
        self._base: list[torch.Tensor] | None = None  # exact copies of the trained tensors (restore=copy)
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
        gen = torch.Generator().manual_seed(
            noise_seed(self.config.seed, iteration, k, block, self.n_noise, self.n_blocks))
        out = self._buffer("noise", numel)
        torch.randn(numel, generator=gen, out=out)
        return out

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
        k, sign = member_noise(member, self.config.antithetic)
        self._shift_all(iteration, k, -sign * self.config.sigma, timing)

    # -- rewards
    def sampling_params(self):
        from deltalens.generation import SamplingParams

        return SamplingParams(n=1, temperature=self.config.temperature, max_new_tokens=self.max_new_tokens,
                              seed=self.config.seed)

    def mean_reward(self, completions: Sequence[str], problems) -> float:
        """Mean reward of one completion per problem."""
        return sum(self.task.score_problem(c, p) for c, p in zip(completions, problems)) / len(problems)

    def score(self, problems) -> float:
        """Mean reward of the current weights on `problems`: one response each (greedy by default)."""
        completions = self.generator.generate([p.prompt for p in problems], self.sampling_params())
        return self.mean_reward([c[0] for c in completions], problems)

    def evaluate_members(self, iteration: int, members: Sequence[int], problems=None,
                         timing: dict | None = None) -> dict[int, float]:
        """Reward of each member: perturb, generate + score, restore, members one after another; or,
        with `population_batch` > 1, that many members per batched generation (deltalens.es_population)."""
        timing = timing if timing is not None else new_timing()
        problems = problems if problems is not None else iteration_problems(self.task, self.config, iteration)
        if self.config.population_batch > 1:
            from deltalens.es_population import evaluate_batched

            return evaluate_batched(self, iteration, members, problems, timing)
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


def new_timing() -> dict:
    return {"generation_s": 0.0, "noise_s": 0.0, "perturb_restore_s": 0.0}


# ----------------------------------------------------------------------------------------------
# backends: who evaluates the members


class LocalBackend:
    """Members evaluated one after another in this process, on the driver's own replica."""

    name = "local"

    def __init__(self, engine: ESEngine):
        self.engine = engine

    def evaluate(self, iteration: int, problems) -> tuple[list[float], dict]:
        timing = new_timing()
        r = self.engine.evaluate_members(iteration, range(self.engine.config.population), problems, timing)
        return [r[i] for i in range(self.engine.config.population)], timing

    def update(self, iteration: int, z: Sequence[float]) -> dict:
        out = self.engine.update(iteration, z)
        t0 = time.perf_counter()
        out["checksum"] = self.engine.checksum()
        out["checksum_s"] = time.perf_counter() - t0
        return out

    def close(self) -> None:
        pass


def make_backend(config: ESConfig, engine: ESEngine, model_spec: str, options: dict | None = None):
    if config.backend == "local":
        return LocalBackend(engine)
    if config.backend == "vllm":  # perturbs vLLM's own fused weights in place (docs/vllm.md)
        from deltalens.vllm_backend import VLLMESBackend

        return VLLMESBackend(engine, model_spec, **(options or {}))
    from deltalens.es_ray import RayBackend

    return RayBackend(engine, model_spec, **(options or {}))


# ----------------------------------------------------------------------------------------------
# the training loop


@dataclass
class ESState:
    """Everything besides the weights that a resume needs: the run seed and the completed step."""

    seed: int
    step: int  # iterations completed (= updates applied)
    checksum: str | None = None  # weights checksum after `step` (verified on resume)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"method": "es", "iteration": self.step, "seed": self.seed, "checksum": self.checksum, **self.extra}


def held_out_pass_at_1(engine: ESEngine, limit: int) -> dict:
    """Greedy Pass@1 (one response, temperature 0) on the first `limit` test problems."""
    from deltalens.evaluation import evaluate

    t0 = time.perf_counter()
    r = evaluate(engine.model, engine.tok, engine.task, samples=1, ks=[1], temperature=0.0, limit=limit,
                 max_new_tokens=engine.max_new_tokens, backend=engine.generator)
    return {"pass_at_1": r["pass_at_k"]["1"], "mean_reward": r["mean_reward"], "n_problems": r["n_problems"],
            "eval_s": round(time.perf_counter() - t0, 3)}


def _check_resume(stored: ESConfig, given: ESConfig, run_dir: Path) -> None:
    diff = [f for f in ESConfig.TRAJECTORY if getattr(stored, f) != getattr(given, f)]
    if diff:
        pairs = ", ".join(f"{f}: run has {getattr(stored, f)!r}, given {getattr(given, f)!r}" for f in diff)
        raise DeltalensError(f"cannot resume {run_dir} with different settings ({pairs}); "
                             "resume with the run's settings or start a new run with --out")


def train_es(config: ESConfig, out: str | Path, resume: bool = False,
             progress: Callable[[int, int, dict | None], None] | None = None, *,
             overwrite: bool = False, backend_options: dict | None = None) -> Path:
    """Run (or resume) ES training into the run directory `out`; returns its path.

    progress(done, total, row) is called once before the first iteration (row None) and after every
    iteration with its metrics row. With `resume`, the run continues from its last checkpoint and ends
    bit-identical to an uninterrupted run; only non-trajectory settings (iterations, eval/checkpoint
    cadence, backend, workers) may differ from the stored config. `backend_options` go to the backend
    (tests use {"fail_at": (iteration, member)} to kill a Ray worker).
    """
    from deltalens import __version__
    from deltalens.models import load_model
    from deltalens.runs import RunDir

    run = RunDir(out)
    state = None
    if resume:
        if not (run.path / "config.json").exists():
            raise DeltalensError(f"nothing to resume in {run.path} (no config.json); drop --resume to start a run")
        _check_resume(ESConfig.from_dict(run.config()), config, run.path)
        state = run.state() if run.latest() is not None else None
        if state and state["iteration"] > config.iterations:
            raise DeltalensError(f"{run.path} already has {state['iteration']} iterations; "
                                 f"pass --iterations {state['iteration']} or more")
        if state and state["checkpoint"] == "final" and state["iteration"] < config.iterations:
            state = run.reopen_final(state)  # growing a finished run: `final` must not name old weights
        from deltalens.checkpoint import write_json_atomic

        write_json_atomic({**config.to_dict(), "deltalens_version": __version__}, run.path / "config.json")
    else:
        run.create({**config.to_dict(), "deltalens_version": __version__}, overwrite=overwrite)

    start = state["iteration"] if state else 0
    model_spec = str(run.latest()) if start > 0 else config.model
    run.truncate_metrics(start if start > 0 else -1)
    if start == config.iterations:
        return run.path

    model, tok = load_model(model_spec, dtype=config.dtype, device=config.device)
    task = make_task(config)
    engine = ESEngine(model, tok, task, config)
    if state and state.get("checksum") and start > 0 and engine.checksum() != state["checksum"]:
        raise DeltalensError(f"checkpoint {model_spec} does not match the checksum in state.json; "
                             "it was modified or is corrupt: restore it or start a new run")
    backend = make_backend(config, engine, model_spec, backend_options)
    try:
        if start == 0 and config.eval_every:
            run.log({"iteration": 0, "eval": held_out_pass_at_1(engine, config.eval_limit)})
        if progress:
            progress(start, config.iterations, None)
        for it in range(start + 1, config.iterations + 1):
            row = _iteration(engine, backend, it)
            if config.eval_every and (it % config.eval_every == 0 or it == config.iterations):
                row["eval"] = held_out_pass_at_1(engine, config.eval_limit)
            run.log(row)
            st = ESState(config.seed, it, row["checksum"])
            if it == config.iterations:
                run.save(model, tok, "final", st.to_dict(), save_pt=config.save_pt)
            elif config.checkpoint_every and it % config.checkpoint_every == 0:
                run.save(model, tok, f"iter-{it:06d}", st.to_dict(), save_pt=config.save_pt)
            if progress:
                progress(it, config.iterations, row)
    finally:
        backend.close()
        engine.close()
    return run.path


def _iteration(engine: ESEngine, backend, it: int) -> dict:
    """One ES iteration through `backend`; returns the metrics row."""
    cfg = engine.config
    t0 = time.perf_counter()
    problems = iteration_problems(engine.task, cfg, it)
    rewards, timing = backend.evaluate(it, problems)
    z = fitness_shaping(rewards, cfg.fitness)
    upd = backend.update(it, z)
    n = len(rewards)
    mean = sum(rewards) / n
    timing.update({k: upd[k] for k in ("update_s", "update_noise_s", "checksum_s")})
    timing["iteration_s"] = time.perf_counter() - t0
    return {
        "iteration": it,
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "reward_min": min(rewards),
        "reward_max": max(rewards),
        "rewards": rewards,
        "fitness": z,
        "seeds": engine.member_seeds(it),
        "update_rms": upd["update_rms"],
        "checksum": upd["checksum"],
        "timing": {k: round(v, 4) for k, v in timing.items()},
        **({"workers": upd["workers"]} if "workers" in upd else {}),
    }
