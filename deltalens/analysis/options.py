"""Options of the analysis commands: one config dataclass each (`ReportConfig`, `DiffConfig`, `SparsifyConfig`,
`DiversityConfig`, `ProbeConfig`), declared like the training configs (`deltalens.config.option`: a default
and one help line per field), so `deltalens report|diff|sparsify|diversity|probe` generate their typer
options, `--config FILE` and the refusal of unused options from them (`deltalens.cli.options`).

Options several commands share (task, samples, K, temperature, limit, seed, dtype, chat template, ...) come
from the one table in `deltalens.evaluation.options` (`shared`), so the same thing has the same name, help
and default everywhere; a command states only what differs (a report evaluates 100 problems unless told
otherwise, a diversity run samples 4 completions per member). Positional arguments (BASE, MODELS, CKPT)
are not options and stay on the commands. The values are checked where they are used (`check_eval_options`,
`check_points`, `check_probe_options`, ...), before any model loads; this module imports no torch.

`needs` rules say where an option means nothing: a report without `--task` evaluates nothing, so its
evaluation options are refused there; `--fisher-samples` only counts with a σ `--sweep`; `--compute-dtype`
only with the HF backend (vLLM casts its own; a probe's ES populations always score in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from deltalens.config import NOT_NONE, Config, check, option
from deltalens.evaluation.options import COMPUTE_DTYPES_HELP, HF_ONLY, shared

REPORT_LIMIT = 100  # default test problems of a report's evaluations (minutes on tiny; README)
SPARSIFY_LIMIT = 100  # default test problems: a sweep of 6 evaluations x 100 x 32 fits minutes on tiny (README)
WITH_TASK = ("task", NOT_NONE)  # `needs`: a report evaluates (and samples, sparsifies, ...) only with --task
PROBE_TEMPERATURES = (0.6, 1.0)  # a probe's sampled pass: the paper's evaluation temperature and GRPO's training one


# A report compares models that differ by small updates: bf16 rounds a weight to ~0.4% of its size, which can
# hide an ES update (per-element steps of ~1e-4 beside norm weights of ~1), so its evaluations stay fp32 unless asked.
REPORT_COMPUTE_HELP = ("what its evaluations generate in: fp32 (the default here: a report compares models that "
                       "differ by small updates, which bf16's ~0.4% rounding can hide), bf16, or auto (bf16 on a "
                       "CPU with AMX-BF16 or AVX512-BF16 or a bf16 GPU for hidden size >= 512)")


@dataclass
class ReportConfig(Config):
    """Options of `deltalens report BASE MODELS...`."""

    NAME: ClassVar[str] = "report"

    out: str | None = option(None, "directory of the report: report.html, analysis.json and cache/ (default "
                                   "./deltalens-report)", flags=("-o",), old="output")
    label: tuple[str, ...] = option((), "label per model (repeat; default: file stems)", repeat=True)
    task: str | None = shared("task", help="evaluate Pass@K curves on this task")
    data: str | None = shared("data", needs=WITH_TASK)
    samples: int = shared("samples", needs=WITH_TASK)
    k: str = shared("k", needs=WITH_TASK)
    temperature: float = shared("temperature", needs=WITH_TASK)
    limit: int | None = shared("limit", REPORT_LIMIT, (
        f"first N test problems of every evaluation (default {REPORT_LIMIT}: base + 2 models x 100 problems x 32 "
        "samples with 2 thresholds took 52 s on tiny on 2 CPU cores; the cost is printed before starting)"),
        needs=WITH_TASK)
    thresholds: str | None = option(None, "sparsify at these thresholds τ on |Δ|, e.g. 2.5e-4,5e-4 (as in "
                                          "`deltalens sparsify`; --sparsify: the old name)", flags=("--sparsify",),
                                    needs=WITH_TASK)
    sparsity: str | None = option(None, "target sparsities, e.g. 0.5,0.9,0.99", needs=WITH_TASK)
    diversity: bool = option(False, "population JS and coverage (ES runs)", flags=("--diversity",),
                             needs=WITH_TASK)
    held_out: str | None = option(None, "held-out tasks, e.g. arith-long,arith-big", needs=WITH_TASK)
    arch: str | None = shared("arch")
    seed: int = shared("seed", needs=WITH_TASK)
    no_cache: bool = option(False, "recompute everything", flags=("--no-cache",))
    chat_template: str = shared("chat_template", needs=WITH_TASK)
    compute_dtype: str = shared("compute_dtype", "fp32", REPORT_COMPUTE_HELP, needs=WITH_TASK)


@dataclass
class DiffConfig(Config):
    """Options of `deltalens diff BASE CKPTS...`."""

    NAME: ClassVar[str] = "diff"

    json: str | None = shared("json")
    csv: str | None = option(None, "write tensor/layer/group metrics as CSV")
    tol: float = option(1e-6, "|Δ| above this counts in frac_above_tol")
    topk: int = option(100, "coordinates in the top-|Δ| lists (0 = none)")
    strict: bool = option(False, "fail on any name/shape/dtype mismatch", flags=("--strict",))
    label: tuple[str, ...] = option((), "label per checkpoint (repeat)", repeat=True)
    svd: int = option(0, "top-N singular values + effective rank of 2-D ΔW")
    arch: str | None = shared("arch")


@dataclass
class SparsifyConfig(Config):
    """Options of `deltalens sparsify CKPT`."""

    NAME: ClassVar[str] = "sparsify"

    base: str = option("tiny", "the model it was fine-tuned from (θ0, architecture)")
    arch: str | None = shared("arch")
    thresholds: str = option("2.5e-4,5e-4", "comma-separated τ on |Δ| ('' = none)")
    sparsity: str = option("0.5,0.9", "comma-separated target sparsities ('' = none)")
    task: str | None = shared("task")
    samples: int = shared("samples")
    k: str = shared("k")
    temperature: float = shared("temperature")
    limit: int | None = shared("limit", SPARSIFY_LIMIT, (
        f"evaluate the first N test problems (default {SPARSIFY_LIMIT}: the defaults are 6 evaluations x 100 "
        "problems x 32 samples, 70 s on tiny on 2 CPU cores; the cost is printed before starting)"))
    seed: int = shared("seed")
    out: str | None = option(None, "also save each sparsified checkpoint here")
    json: str | None = shared("json")
    label: str | None = option(None, "label of the checkpoint")
    chat_template: str = shared("chat_template")
    backend: str = shared("backend", help="backend of the re-evaluations: hf (one model in memory), or vllm (one "
                                          "engine of the base, each state dict loaded into it; docs/vllm.md)")
    compute_dtype: str = shared("compute_dtype", needs=HF_ONLY)


@dataclass
class DiversityConfig(Config):
    """Options of `deltalens diversity MODEL`."""

    NAME: ClassVar[str] = "diversity"

    task: str | None = shared("task")
    members: int | None = option(None, "population size N (default: the run's with --iteration, else 32)",
                                 flags=("-N",))
    sigma: float | None = option(None, "noise scale σ (default: the run's with --iteration, else 1.5e-3; 0 = N "
                                       "copies)")
    iteration: int | None = option(None, "ES run: centre after this many iterations, members = the run's next "
                                         "population")
    prompts: int = option(16, "held-out prompts (first P test problems)", flags=("-p",))
    samples: int = shared("samples", 4, "samples per member and prompt (M)")
    temperature: float = shared("temperature")
    sweep: str | None = option(None, "comma-separated σ values: also measure JS vs the small-σ law (same noise)")
    fisher_samples: int = option(32, "samples per prompt for the Fisher trace (with --sweep)",
                                 needs=("sweep", NOT_NONE))
    max_new_tokens: int | None = shared("max_new_tokens")
    seed: int = shared("seed")
    label: str | None = option(None, "label of the model in the JSON")
    data: str | None = shared("data")
    question_field: str = shared("question_field")
    answer_field: str = shared("answer_field")
    dtype: str | None = shared("dtype", None, "model dtype: fp32, bf16, fp16 (default: the run's, else fp32)")
    arch: str | None = shared("arch")
    json: str | None = shared("json")
    chat_template: str = shared("chat_template")
    compute_dtype: str = shared("compute_dtype")


@dataclass
class ProbeConfig(Config):
    """Options of `deltalens probe MODEL`. The sampled pass's temperatures: --temperatures (a Pass@K curve at
    each), or --temperature T (T alone); neither given: PROBE_TEMPERATURES; the two together are refused."""

    NAME: ClassVar[str] = "probe"

    task: str | None = shared("task")
    split: str = shared("split", "validation")
    limit: int | None = shared("limit", 200, "problems of the split")
    samples: int = shared("samples", help="samples per problem (K of Pass@K)")
    group: int = option(8, "GRPO group size G (groups are cut from the samples)", flags=("-G",))
    temperature: float | None = shared("temperature", None, "one sampling temperature, instead of --temperatures "
                                       "(0 = greedy; GRPO trains at 1.0)")
    temperatures: tuple[float, ...] | None = option(
        None, "sampling temperatures, comma-separated: the sampled pass (Pass@K curve, reward, format rate, GRPO "
              "groups) at each; the verdict uses 1.0 (GRPO's) when listed, else the first",
        default_text=",".join(map(str, PROBE_TEMPERATURES)))
    es_members: int = option(8, "members per ES population")
    es_prompts: int = option(16, "training prompts per ES population")
    es_populations: int = option(2, "ES populations scored (0 = skip ES)")
    es_sigma: float | None = option(None, "ES noise scale (default: the preset's)")
    preset: str | None = option(None, "ES preset for σ (default: the model's own)")
    chat_template: str = shared("chat_template")
    max_new_tokens: int | None = shared("max_new_tokens")
    data: str | None = shared("data")
    question_field: str = shared("question_field")
    answer_field: str = shared("answer_field")
    dtype: str = shared("dtype")
    backend: str = shared("backend", help="backend of the sampled and greedy passes: hf, or vllm (docs/vllm.md); "
                                          "ES populations always score on HF, as training does")
    seed: int = shared("seed")
    json: str | None = shared("json")
    compute_dtype: str = shared("compute_dtype", needs=HF_ONLY, help=(
        "what the HF passes and the ES populations generate in: " + COMPUTE_DTYPES_HELP +
        " (ES: auto keeps fp32 where σ would drown in a bf16 matrix, as in `train es`)"))

    def __post_init__(self):
        if self.temperatures is not None:
            self.temperatures = tuple(self.temperatures)
        check([(self.temperature is None or self.temperatures is None,
                "give --temperature or --temperatures, not both")])
