"""`StudyConfig`: the settings of `deltalens study`, and `SweepConfig`: a sweep's own (grid, seeds, validation
scoring); one help line each, CLI options generated from them. Torch-free, so the CLI builds its options
without loading the trainers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from deltalens.config import Config, check, coerce, flag_name, option
from deltalens.errors import DeltalensError
from deltalens.methods import run_methods
from deltalens.presets import default_task
from deltalens.study.cluster import ray_checks, ray_option
from deltalens.training.budget import parse_budget
from deltalens.training.es.config import ESConfig
from deltalens.training.grpo.config import GRPOConfig
from deltalens.training.tracking import HELP as REPORT_TO_HELP
from deltalens.training.tracking import normalize_report_to

COMPUTE_DTYPES = ("auto", "fp32", "bf16")  # deltalens.generation.dtype.COMPUTE_DTYPES (that module needs torch)
PAPER_TEMPERATURE = 0.6  # the paper's evaluation temperature: claim 1's verdict uses it when it is evaluated
POPULATION_ALPHA = ("fixed", "scaled")  # --population-alpha: the extra ES runs' α (`runs._es_variant`)


def seeds_checks(seeds: tuple[int, ...]) -> list[tuple[bool, str]]:
    """The checks of a --seeds list of training seeds (`deltalens.config.check`), on a study and a sweep: at
    least one, distinct, each >= 0."""
    return [(bool(seeds) and len(set(seeds)) == len(seeds), "--seeds must be distinct integers"),
            (all(x >= 0 for x in seeds), f"--seeds must be >= 0 (got {','.join(map(str, seeds))})")]


# settings a study sets itself (or that would make its runs another study's), so --es-options and
# --grpo-options refuse them
STUDY_SET_ES = ("model", "task", "data", "question_field", "answer_field", "seed", "budget", "iterations",
                "chat_template", "report_to", "init_from", "keep_checkpoints")
STUDY_SET_GRPO = ("model", "init_from", "task", "data", "question_field", "answer_field", "seed", "budget", "steps",
                  "chat_template", "report_to", "keep_checkpoints")
RUN_OPTIONS = {"es": (ESConfig, STUDY_SET_ES), "grpo": (GRPOConfig, STUDY_SET_GRPO)}  # method: (config, study-set)


def parse_run_options(method: str, specs) -> dict:
    """--es-options / --grpo-options: ["population=32", "alpha=5e-4"] -> {"population": 32, "alpha": 0.0005},
    typed by the method's config (RUN_OPTIONS: ESConfig, GRPOConfig); unknown names, names the study sets
    itself (STUDY_SET_ES, STUDY_SET_GRPO), list-valued settings (a comma would split them) and a name given twice are refused in one
    line. The values themselves are checked by the config when a run's config is resolved."""
    cls, study_set = RUN_OPTIONS[method]
    flag = f"--{method}-options"
    types, out = cls.types(), {}
    for spec in specs:
        key, sep, value = str(spec).partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key or not value.strip():
            raise DeltalensError(f"{flag} must be name=value, comma-separated (got {spec!r})")
        if key not in types or not cls.field(key).metadata.get("cli", True):
            raise DeltalensError(f"{flag} {key}: {cls.NAME} has no option {flag_name(key)} "
                                 f"(see `deltalens train {method} --help`)")
        if key in study_set:
            raise DeltalensError(f"{flag} {key}: the study sets {flag_name(key)} itself"
                                 + (" (use --seeds)" if key == "seed" else " (use --budget)" if key in
                                    ("budget", "iterations", "steps") else ""))
        if isinstance(cls.field(key).default, tuple):
            raise DeltalensError(f"{flag} {key}: list-valued settings cannot be given here")
        if key in out:
            raise DeltalensError(f"{flag} names {key} twice")
        value = value.strip()
        if isinstance(cls.field(key).default, bool):  # command-line text: true/false
            value = {"true": True, "false": False}.get(value.lower(), value)
        out[key] = coerce(value, types[key], key, flag)
    return out


@dataclass
class StudyConfig(Config):
    """Settings of a study (one help line each; `deltalens study --help`); --ray, --cpus-per-run, --gpus-per-run
    and --ray-files are `deltalens.study.cluster.RayOptions`' (`ray_option`), shared with `deltalens sweep`."""

    METHOD: ClassVar[str] = "study"
    NAME: ClassVar[str] = "study"

    model: str = option("tiny", "base model spec", cli=False)
    task: str | None = option(None, "task spec (default: the model's own, else arith)", flags=("-t",))
    methods: tuple[str, ...] = option(("es", "grpo", "es-grpo"), "methods, comma-separated: es, grpo, es-grpo, "
                                      "grpo-es")
    seeds: tuple[int, ...] = option((0, 1, 2), "training seeds of every method, comma-separated")
    budget: float | str | None = option(None, "FLOP-matched units per method (default: 20 ES iterations of the "
                                        "model's ES preset)")
    preset: str = option("auto", "hyperparameter preset of every run: auto (the model's own), paper, tiny, ...")
    base_seeds: int = option(3, "sampling seeds of the base model's evaluation")
    limit: int | None = option(None, "test problems evaluated (default: the whole test split)")
    samples: int = option(32, "samples per problem (the paper's 32)", flags=("-n",))
    temperature: float | None = option(None, "evaluation sampling temperature (default: the paper's 0.6); one "
                                       "value, as --temperatures T")
    temperatures: tuple[float, ...] | None = option(None, "evaluation temperatures, comma-separated (e.g. 0.6,1.0: "
                                                    "T=1.0 beside the paper's 0.6 checks a cold-base artefact); "
                                                    "claim 1's verdict uses 0.6 when listed, else the first")
    k: tuple[int, ...] = option((1, 16, 32), "K values of Pass@K and Maj@K", old="ks")
    sparsity: tuple[float, ...] = option((0.5, 0.9, 0.99), "target sparsities of the thresholding (claim 3)")
    sparsify_samples: int = option(8, "samples per problem of the sparsity evaluations (Pass@1)")
    diversity_members: int = option(8, "ES population size of the diversity measurement (claims 9 and 10)")
    diversity_prompts: int = option(16, "test prompts of the diversity measurement")
    entropy_prompts: int = option(100, "test prompts of the token-entropy measurement (claim 8)")
    first_run_measures: bool = option(True, "the sparsity sweep (claim 3) and the population pass (claims 9, 10) of "
                                      "each method's first run; --no-first-run-measures for a piece of a study "
                                      "whose first seeds ran elsewhere (`deltalens study merge` takes them from "
                                      "there)")
    held_out: tuple[str, ...] = option((), "held-out tasks evaluated for forgetting, comma-separated (e.g. arith-3)")
    chat_template: str = option("auto", "prompts through the tokenizer's chat template: auto, on, off")
    backend: str = option("hf", "backend of the Pass@K and sparsity evaluations: hf, or vllm (docs/vllm.md); "
                          "training, entropy and diversity always run on HF")
    compute_dtype: str = option("auto", "what the HF backend's Pass@K and sparsity evaluations generate in: auto "
                                "(bf16 on a CPU with AMX-BF16 or AVX512-BF16 or a bf16 GPU, for hidden size >= 512; "
                                "else fp32), fp32, bf16; entropy and diversity score in fp32, training uses each "
                                "method's own setting")
    report_to: str = option("none", REPORT_TO_HELP + "; each training run logs in its own directory")
    keep_checkpoints: bool = option(False, "keep every training run's intermediate checkpoints (iter-N, for "
                                    "`deltalens diversity --iteration`); by default each run keeps only its latest, "
                                    "the one a resume reads, and once finished only final: the study reads no other "
                                    "(ES on qwen2.5-0.5b writes 2.4 GB every 10 iterations)")
    resamples: int = option(10000, "bootstrap resamples of every interval (heavy-tailed t draws at 2 seeds need many)")
    population_sizes: tuple[int, ...] = option((), "claim 6: extra ES runs at these population sizes N (every "
                                               "seed, same budget: smaller N, more iterations), e.g. 4,8,16")
    two_point: bool = option(False, "claim 7: an extra two-point ES run per seed (N=2, one antithetic pair) at "
                             "the same budget, compared with ES at N=16 (the es runs if the preset's N is 16, "
                             "else es-n16 runs, added unless --population-sizes lists 16)")
    population_alpha: str = option("fixed", "claims 6 and 7: α of the extra ES runs (es-n<N>, es-2pt): fixed "
                                   "(the study's α at every N) or scaled (α·N/N_ref, N_ref the es runs' N: at one "
                                   "budget every N then moves, to first order, as far along the gradient and as far "
                                   "by noise as the es runs; docs/reproduction.md)")
    es_options: tuple[str, ...] = option((), "settings of every ES run (es, es-n<N> but their N, es-2pt but its N, "
                                         "ES->GRPO's ES stage) over the preset: name=value, comma-separated, "
                                         "the names of `deltalens train es` (e.g. population=32: claim 6 across "
                                         "models needs one reference N)")
    grpo_options: tuple[str, ...] = option((), "settings of every GRPO run (grpo, ES->GRPO's GRPO stage) over the "
                                           "preset: name=value, comma-separated, the names of `deltalens train "
                                           "grpo` (e.g. autocast=bf16)")
    ray: str | None = ray_option("ray")
    cpus_per_run: float = ray_option("cpus_per_run")
    gpus_per_run: float = ray_option("gpus_per_run")
    ray_files: str = ray_option("ray_files")
    noninferiority_margin: float = option(0.02, "non-inferiority margin of a 'keeps' check (ES keeps Pass@16/32): "
                                          "reproduced when method minus base is surely above -margin")

    def __post_init__(self):
        self.methods, self.seeds, self.k = tuple(self.methods), tuple(self.seeds), tuple(sorted(set(self.k)))
        self.sparsity, self.held_out = tuple(self.sparsity), tuple(self.held_out)
        self.population_sizes = tuple(sorted(set(self.population_sizes)))
        if self.temperatures is not None:
            self.temperatures = tuple(self.temperatures)
        temps = self.eval_temperatures if self.temperatures is None or self.temperature is None else ()
        self.report_to = normalize_report_to(self.report_to)
        check([
            (bool(self.methods) and set(self.methods) <= set(run_methods()),
             f"--methods must be among {', '.join(run_methods())} (got {','.join(self.methods)})"),
            (len(set(self.methods)) == len(self.methods), "--methods lists a method twice"),
            *seeds_checks(self.seeds),
            (self.base_seeds >= 1, f"--base-seeds must be >= 1 (got {self.base_seeds})"),
            (self.limit is None or self.limit >= 2, f"--limit must be >= 2 (got {self.limit})"),
            (self.samples >= 1 and max(self.k) <= self.samples and min(self.k) >= 1,
             f"--k must lie in 1..--samples {self.samples} (got {list(self.k)})"),
            (self.temperature is None or self.temperatures is None,
             "give --temperature or --temperatures, not both"),
            (all(math.isfinite(t) and t > 0 for t in temps), "--temperature(s) must be > 0 (sampling)"),
            (len(set(temps)) == len(temps) and (self.temperatures is None or bool(self.temperatures)),
             "--temperatures must be distinct values"),
            (all(n >= 2 for n in self.population_sizes), "--population-sizes must be >= 2"),
            (self.population_alpha in POPULATION_ALPHA,
             f"--population-alpha must be fixed or scaled (got {self.population_alpha!r})"),
            (not (self.population_sizes or self.two_point) or "es" in self.methods,
             "--population-sizes and --two-point need the es runs: add es to --methods"),
            *ray_checks(self),  # --ray and its companions (deltalens.study.cluster)
            (all(0 < s < 1 for s in self.sparsity), "--sparsity values must lie in (0, 1)"),
            (self.sparsify_samples >= 1 and self.diversity_members >= 2 and self.diversity_prompts >= 1
             and self.entropy_prompts >= 1, "sample, member and prompt counts must be positive (members >= 2)"),
            (self.resamples >= 100, f"--resamples must be >= 100 (got {self.resamples})"),
            (math.isfinite(self.noninferiority_margin) and 0 <= self.noninferiority_margin < 1,
             f"--noninferiority-margin must lie in [0, 1) (got {self.noninferiority_margin})"),
            (self.backend in ("hf", "vllm"), f"--backend must be hf or vllm (got {self.backend!r})"),
            (self.compute_dtype in COMPUTE_DTYPES,
             f"--compute-dtype must be one of {', '.join(COMPUTE_DTYPES)} (got {self.compute_dtype!r})"),
            (self.compute_dtype in ("auto", "fp32") or self.backend == "hf",
             f"--compute-dtype {self.compute_dtype} is the HF backend's; vLLM computes in the dtype it loads"),
        ])
        if self.budget is not None:
            self.budget = parse_budget(self.budget)
        self.es_options, self.grpo_options = tuple(self.es_options), tuple(self.grpo_options)
        for method in RUN_OPTIONS:  # refuses a bad --es-options / --grpo-options now, before anything is written
            self.method_settings(method)

        if self.task is None:
            self.task = default_task(self.model)

    @property
    def es_settings(self) -> dict:
        """--es-options as typed ESConfig values: {"population": 32, ...} (`parse_run_options`)."""
        return self.method_settings("es")

    @property
    def grpo_settings(self) -> dict:
        """--grpo-options as typed GRPOConfig values: {"autocast": "bf16", ...} (`parse_run_options`)."""
        return self.method_settings("grpo")

    def method_settings(self, method: str) -> dict:
        """The options over the preset of a run (or chain stage) of `method`: --es-options for es,
        --grpo-options for grpo, none for another method."""
        return parse_run_options(method, getattr(self, f"{method}_options")) if method in RUN_OPTIONS else {}

    @property
    def eval_temperatures(self) -> tuple[float, ...]:
        """Every temperature the evaluations run at (--temperatures, else --temperature, else the paper's)."""
        if self.temperatures is not None:
            return self.temperatures
        return (self.temperature if self.temperature is not None else PAPER_TEMPERATURE,)

    @property
    def verdict_temperature(self) -> float:
        """The temperature of the verdicts and of every other measurement (sparsity, entropy, diversity): the
        paper's 0.6 when evaluated (claim 1 is the paper's statement at its setting), else the first given."""
        temps = self.eval_temperatures
        return PAPER_TEMPERATURE if PAPER_TEMPERATURE in temps else temps[0]


@dataclass
class SweepConfig(Config):
    """A sweep's own options (`deltalens sweep`; one help line each); its method's fixed options and Ray's are
    their configs' (`deltalens.study.sweep`, `deltalens.study.cluster.RayOptions`)."""

    METHOD: ClassVar[str] = "sweep"
    NAME: ClassVar[str] = "sweep"

    grid: tuple[str, ...] = option((), "an option and its values, name=v1,v2 (repeat for a product grid), e.g. "
                                   "sigma=3e-3,6e-3; in --config a list of those, or a mapping of names to values",
                                   repeat=True)
    # as study --seeds: the same type (so the same parsing) and checks (`seeds_checks`), a sweep's help line
    seeds: tuple[int, ...] = option((0,), "training seeds of every point, comma-separated")
    preset: str | None = option(None, "hyperparameter preset under every point: auto (the model's own), paper, "
                                "tiny, ...")
    val_limit: int = option(200, "validation problems scored (first N)")
    val_samples: int = option(8, "samples per validation problem")
    val_temperature: float = option(0.6, "sampling temperature of the scoring (0 = greedy, with --val-samples 1)")

    def __post_init__(self):
        self.grid, self.seeds = tuple(self.grid), tuple(self.seeds)
        check(seeds_checks(self.seeds))
