"""`ESConfig`: every hyperparameter of an ES run, one help line each (defaults are the paper's).

The fields are the single source of `deltalens train es` options, YAML keys and the run's config.json
(`deltalens.config`). Presets: `paper` (the defaults) and `tiny` (for the bundled 0.76M-parameter model;
how it was chosen is in docs/tuning.md).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import ClassVar

from deltalens.config import AtLeast, Config, check, option
from deltalens.generation.prompts import CHAT_MODES
from deltalens.training.budget import iterations_for_budget, parse_budget
from deltalens.training.tracking import HELP as REPORT_TO_HELP
from deltalens.training.tracking import normalize_report_to

FITNESS = ("zscore", "centered_rank")
NOISE = ("full", "lowrank")  # built-in noise families (deltalens.training.es.noise, deltalens.training.es.lowrank)
COMPUTE_DTYPES = ("auto", "fp32", "bf16")  # deltalens.generation.dtype.COMPUTE_DTYPES (that module needs torch)
BACKENDS = ("local", "ray", "vllm")
ARITHMETIC = ("deltalens", "reference")
DEFAULT_ITERATIONS = 100


def noise_families() -> tuple[str, ...]:
    """The noise families a config may name: the built-in ones and any registered since with
    `deltalens.training.es.noise.register` (looked up without importing it: this module stays torch-free)."""
    registered = getattr(sys.modules.get("deltalens.training.es.noise"), "FAMILIES", {})
    return NOISE + tuple(n for n in registered if n not in NOISE)


# the `smollm2` ES preset (see ESConfig.PRESETS), which `qwen2.5` rescales
SMOLLM2_PRESET = {"population": 16, "prompts_per_iteration": 16, "sigma": 3e-3, "alpha": 3e-3, "antithetic": True,
                  "noise": "lowrank", "rank": 1, "population_batch": 16,
                  "eval_every": 10, "eval_limit": 100, "checkpoint_every": 10}


@dataclass
class ESConfig(Config):
    """Hyperparameters of an ES run (deltalens.training.es; arXiv 2509.24372 as used by arXiv 2608.27351)."""

    METHOD: ClassVar[str] = "es"
    NAME: ClassVar[str] = "ES"
    COUNT: ClassVar[str] = "iterations"

    model: str = option("tiny", "model spec: tiny, smollm2, HF dir, run dir, .gguf, hub id", trajectory=True)
    task: str = option("arith", "task name (deltalens.tasks)", flags=("-t",), trajectory=True)
    data: str | None = option(None, "jsonl file or directory for the gsm8k and jsonl tasks", trajectory=True)
    question_field: str = option("question", "jsonl task: question field", trajectory=True)
    answer_field: str = option("answer", "jsonl task: answer field", trajectory=True)
    population: int = option(32, "N: members per iteration (each a full-model perturbation)", flags=("-N",),
                             trajectory=True)
    sigma: float = option(1.5e-3, "σ: noise scale, θ_i = θ + σ ε_i with ε_i ~ N(0, I)", trajectory=True)
    alpha: float = option(2.5e-4, "α: step, θ += (α/N) Σ z_i ε_i (α absorbs 1/σ, as in the paper)",
                          trajectory=True)
    prompts_per_iteration: int = option(64, "P: training prompts per iteration, shared by all members",
                                        flags=("--prompts",), trajectory=True)
    temperature: float = option(0.0, "training decoding temperature (0 = greedy, the paper's setting)",
                                trajectory=True)
    max_new_tokens: int | None = option(None, "generation budget per response (default: the task's)",
                                        trajectory=True)
    chat_template: str = option("auto", "prompts through the tokenizer's chat template: auto (when it has one), "
                                "on, off", trajectory=True)
    antithetic: bool = option(False, "mirrored pairs: member 2k+1 uses -ε of member 2k (population must be even)",
                              trajectory=True)
    fitness: str = option("zscore", "reward shaping: zscore (paper) or centered_rank (evosax style)",
                          trajectory=True)
    params: tuple[str, ...] = option(("*",), "comma-separated globs of parameter names to train; !glob excludes "
                                     "(applied in order)", trajectory=True)
    dtype: str = option("fp32", "weight dtype: fp32, bf16, fp16 (update accumulated in fp32, rounded once)",
                        trajectory=True)
    restore: str = option("copy", "restore after each member: copy (exact, one base copy) or subtract "
                          "(no copy, inexact)", trajectory=True)
    arithmetic: str = option("deltalens", "noise layout and arithmetic: deltalens (a seed per tensor block, fp32, "
                             "exact restore) or reference (Qiu et al.'s script: one seed per member for every "
                             "tensor, weight-dtype noise and update; needs --restore subtract)", trajectory=True)
    iterations: int | None = option(None, f"ES iterations (updates), total also on resume (default "
                                    f"{DEFAULT_ITERATIONS}, or from --budget)")
    budget: float | str | None = option(None, "FLOP-matched compute units (e.g. 2e6, 1.5M): iterations = the most "
                                        "that fit, 2·N·P units each (deltalens.training.budget)")
    eval_every: int = option(10, "greedy Pass@1 on validation problems every k iterations and at the end (0 = never)")
    eval_limit: int = option(64, "number of validation problems in that evaluation")
    checkpoint_every: int = option(10, "HF checkpoint every k iterations (resume points; 0 = only the final one)")
    keep_checkpoints: bool = option(True, "keep every intermediate checkpoint (iter-N); --no-keep-checkpoints keeps only "
                                   "the latest, the one a resume reads, and after the last iteration only final (ES on "
                                   "qwen2.5-0.5b: 2.4 GB each)")
    seed: int = option(0, "run seed: prompts and noise are functions of (seed, iteration, member, block)",
                       trajectory=True)
    backend: str = option("local", "where members are evaluated: local (in-process), ray (actors), vllm (engine)")
    noise_threads: int = option(0, "threads drawing noise blocks in parallel (0 = torch's thread count; same "
                                "results)")
    workers: int = option(2, "ray backend: number of actors (each holds a model replica)",
                          needs=("backend", ("ray",)))
    threads_per_worker: int = option(1, "ray backend: torch threads per actor", needs=("backend", ("ray",)))
    save_pt: bool = option(False, "also write a plain state dict (.pt) beside each checkpoint")
    report_to: str = option("none", REPORT_TO_HELP)
    noise: str = option("full", "noise family: full (dense ε per tensor) or lowrank (EGGROLL: rank-r A·Bᵀ/√r on 2-D "
                        "weights, dense ε on 1-D), or one registered in deltalens.training.es.noise", trajectory=True)
    rank: int = option(1, "lowrank noise: rank r of each 2-D perturbation", needs=("noise", ("lowrank",)),
                       trajectory=True)
    population_batch: int = option(0, "members per batched generation (deltalens.training.es.population); 0 or 1: "
                                   "one by one", trajectory=True)
    shared_prefix: bool = option(True, "population batching: a member's prompts read their common token prefix (chat "
                                 "template, few-shot examples) from one KV cache, prefilled once per member and "
                                 "read once per decoding step (SDPA models; the same completions up to rounding)",
                                 needs=("population_batch", AtLeast(2)), trajectory=True)
    device: str = option("cpu", "local backend: where the model runs (cpu, cuda, cuda:N, auto); noise is drawn on "
                         "the CPU")
    compute_dtype: str = option("auto", "dtype members generate in: auto (bf16 where bf16 matmuls are fast, a CPU "
                                "with AMX-BF16 or AVX512-BF16 or a bf16 GPU, for hidden size >= 512, unless σ is under half a bf16 step of "
                                "some perturbed matrix's median |w| (norm weights stay fp32); else fp32), fp32, bf16; the "
                                "fp32 master is updated as always (with bf16, each member is cast into the bf16 copy and the master is "
                                "never perturbed)", trajectory=True)

    # runs recorded before `shared_prefix` existed (2026-12-06) generated without it: their config.json, read
    # back for a resume or a re-run, keeps that arithmetic
    ABSENT: ClassVar[dict] = {"shared_prefix": False}

    PRESETS: ClassVar[dict[str, dict]] = {
        "paper": {},
        # SmolLM2-135M-Instruct (`smollm2`), chosen on validation problems (docs/tuning.md, 2026-12-01): low-rank
        # (r=1) antithetic noise, σ 2x and α 12x the paper's, N=16, P=16, population-batched; 25 iterations
        # raised greedy validation Pass@1 0.355 -> 0.48 (the paper's σ/α with dense noise, N=16, P=8 did not move it)
        "smollm2": SMOLLM2_PRESET,
        # Qwen2.5-Coder-0.5B-Instruct (`qwen2.5-0.5b`), chosen on validation problems (docs/tuning.md, 2026-12-05):
        # `smollm2` with σ and α scaled to Qwen's weights (matrix median |w| ~0.009 against SmolLM2's ~0.12);
        # `smollm2`'s own σ = 3e-3 took greedy validation Pass@1 0.46 -> 0.38 in 5 iterations
        "qwen2.5": {**SMOLLM2_PRESET, "sigma": 2.5e-4, "alpha": 2.5e-4},
        # for the bundled tiny model; chosen on test problems (no validation split then), re-checked on validation
        # with `deltalens sweep` (2026-12-01: best of σ 3e-3..1.2e-2 and α 1.5e-3..6e-3): docs/tuning.md
        "tiny": {"sigma": 6e-3, "alpha": 3e-3, "antithetic": True, "population": 32, "prompts_per_iteration": 64,
                 "eval_every": 10, "eval_limit": 200, "checkpoint_every": 10},
    }

    def __post_init__(self):
        if isinstance(self.params, str):
            self.params = tuple(p.strip() for p in self.params.split(",") if p.strip())
        self.params = tuple(self.params)
        self.report_to = normalize_report_to(self.report_to)
        check([
            (self.seed >= 0, f"seed must be >= 0 (got {self.seed}); set --seed"),
            (self.population >= 2, f"population must be >= 2 (got {self.population}); set --population"),
            (not self.antithetic or self.population % 2 == 0,
             (f"antithetic pairs need an even population (got {self.population}); set --population to an "
              "even number or drop --antithetic")),
            (self.sigma > 0 and math.isfinite(self.sigma), f"sigma must be > 0 (got {self.sigma}); set --sigma"),
            (self.alpha > 0 and math.isfinite(self.alpha), f"alpha must be > 0 (got {self.alpha}); set --alpha"),
            (self.prompts_per_iteration >= 1,
             f"prompts_per_iteration must be >= 1 (got {self.prompts_per_iteration}); set --prompts"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0 (got {self.temperature}); 0 is greedy"),
            (self.max_new_tokens is None or self.max_new_tokens >= 1,
             f"max_new_tokens must be >= 1 (got {self.max_new_tokens}); set --max-new-tokens"),
            (self.fitness in FITNESS, f"unknown fitness {self.fitness!r}; use one of {', '.join(FITNESS)}"),
            (bool(self.params), "params is empty; give at least one glob, e.g. --params '*'"),
            (self.dtype in ("fp32", "bf16", "fp16"), f"dtype must be fp32, bf16 or fp16 (got {self.dtype!r})"),
            (self.restore in ("copy", "subtract"), f"restore must be copy or subtract (got {self.restore!r})"),
            (self.chat_template in CHAT_MODES, f"chat_template must be auto, on or off (got {self.chat_template!r})"),
            (self.arithmetic in ARITHMETIC, f"arithmetic must be deltalens or reference (got {self.arithmetic!r})"),
            (self.arithmetic != "reference" or self.restore == "subtract",
             ("--arithmetic reference restores by subtracting the noise, as the reference script does: add "
             "--restore subtract")),
        ])
        self._resolve_iterations()
        check([
            (self.iterations >= 1, f"iterations must be >= 1 (got {self.iterations}); set --iterations"),
            (self.eval_every >= 0, f"eval_every must be >= 0 (got {self.eval_every}); 0 disables evaluation"),
            (self.eval_limit >= 1, f"eval_limit must be >= 1 (got {self.eval_limit}); set --eval-limit"),
            (self.checkpoint_every >= 0,
             f"checkpoint_every must be >= 0 (got {self.checkpoint_every}); 0 saves only the final weights"),
            (self.backend in BACKENDS, f"backend must be local, ray or vllm (got {self.backend!r})"),
            (self.noise_threads >= 0, f"noise_threads must be >= 0 (got {self.noise_threads}); 0 = auto"),
            (self.workers >= 1, f"workers must be >= 1 (got {self.workers}); set --workers"),
            (self.threads_per_worker >= 1, f"threads_per_worker must be >= 1 (got {self.threads_per_worker})"),
            (self.noise in noise_families(),
             f"noise must be one of {', '.join(noise_families())} (got {self.noise!r}); set --noise"),
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
            (self.arithmetic == "deltalens" or (self.backend == "local" and self.noise == "full"
                                                 and self.population_batch <= 1),
             "--arithmetic reference runs full-rank noise, member by member, on the local backend"),
            (self.compute_dtype in COMPUTE_DTYPES,
             f"compute_dtype must be auto, fp32 or bf16 (got {self.compute_dtype!r}); set --compute-dtype"),
            (self.compute_dtype == "auto" or self.dtype == "fp32" or self.compute_dtype == self.dtype,
             (f"--compute-dtype {self.compute_dtype} with --dtype {self.dtype}: weights loaded in {self.dtype} "
              "generate in it; drop --compute-dtype or load --dtype fp32")),
            (self.compute_dtype != "bf16" or self.backend != "vllm",
             ("--compute-dtype bf16 is for the local and ray backends: vLLM computes in the dtype it loads; "
              "use --dtype bf16 with --backend vllm, or drop --compute-dtype")),
            (self.backend == "local" or (self.noise == "full" and self.population_batch <= 1),
             (f"--backend {self.backend} supports only full-rank noise evaluated member by member; use "
              "--backend local for --noise lowrank or --population-batch (or drop those options)")),
        ])

    def _resolve_iterations(self) -> None:
        """iterations from the budget (2·N·P units each), else the default; both given must agree."""
        if self.budget is None:
            if self.iterations is None:
                self.iterations = DEFAULT_ITERATIONS
            return
        self.budget = parse_budget(self.budget)
        n = iterations_for_budget(self.budget, self.prompts_per_iteration, self.population)
        if self.iterations is None:
            self.iterations = n
        elif self.iterations != n:
            check([(False, (f"iterations {self.iterations} and budget {self.budget:g} disagree (the budget gives "
                           f"{n} iterations); pass one of --iterations or --budget"))])
