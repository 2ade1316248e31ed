"""Options of the evaluation commands: the shared option table (`SHARED`, `shared`), `EvalConfig` (the
options of `deltalens eval`), and the up-front checks of their values (`check_eval_options`).

One name, one help line and one default per thing, whatever the command: `SHARED` declares each option
several commands take (task, data, samples, K, temperature, limit, seed, ...) once, and a command's config
dataclass takes it with `shared(name)`, naming only what differs for that command (a default, and the help
line where the meaning narrows: a report's problem limit, a diversity run's samples per member). The
commands' typer options are generated from these dataclasses (`deltalens.cli.options`); the module itself
imports no torch.

`evaluate` would refuse most bad values itself, but only once a model is loaded and sampling starts
(minutes into a report or a sparsification sweep); commands call `check_eval_options` first. The
rules are the evaluation's own: `SamplingParams` (samples >= 1, temperature finite >= 0, top_p in
(0, 1]), `parse_ks` (K integers >= 1, at most the samples), and a test-problem limit >= 1 (a negative
one would slice off problems from the end).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from deltalens.config import Config, option
from deltalens.errors import DeltalensError
from deltalens.evaluation.passk import parse_ks
from deltalens.generation import SamplingParams

COMPUTE_DTYPES_HELP = (  # the choices; COMPUTE_DTYPE_HELP says who generates in them
    "fp32; bf16 (a bf16 copy of fp32 weights); auto (bf16 on a CPU with "
    "AMX-BF16 or AVX512-BF16 or a GPU with bf16 for models of hidden size >= 512, measured ~2x faster on SmolLM2, benchmarks/README.md; else "
    "fp32); --dtype bf16/fp16 weights generate as they are")
COMPUTE_DTYPE_HELP = "what the HF backend generates in: " + COMPUTE_DTYPES_HELP
ARCH_HELP = ("architecture (tiny, smollm2, an HF/run directory, a config.json) for every bare .pt/.safetensors "
             "input of the command, the base included; default: the config.json beside each file")
HF_ONLY = ("backend", ("hf",))  # `needs`: an option of the HF backend only (vLLM places and casts its own)

# name -> (type, default, help, extra `option` keywords): every option shared by several commands
SHARED: dict[str, tuple[Any, Any, str, dict]] = {
    "task": (str | None, None, ("task spec: arith, add:digits=2,terms=3, countdown, gsm8k, jsonl, ... (default: "
                                "the model's own, else arith)"), {"flags": ("-t",)}),
    "data": (str | None, None, "jsonl file or directory (gsm8k, jsonl tasks)", {}),
    "question_field": (str, "question", "jsonl task: question field name", {}),
    "answer_field": (str, "answer", "jsonl task: answer field name", {}),
    "samples": (int, 32, "samples per problem", {"flags": ("-n",)}),
    "k": (str, "1,16,32", "comma-separated K values for Pass@K / Maj@K", {}),
    "temperature": (float, 0.6, "sampling temperature (0 = greedy)", {}),
    "limit": (int | None, None, "evaluate only the first N test problems", {}),
    "seed": (int, 0, "random seed (>= 0)", {"min": 0}),
    "max_new_tokens": (int | None, None, "generation budget (default: task's)", {}),
    "backend": (str, "hf", "generation backend: hf, or vllm (GPU or CPU build; docs/vllm.md)", {}),
    "device": (str, "auto", "where the HF backend runs the model: cpu, cuda, cuda:N, auto", {}),
    "dtype": (str, "fp32", "model dtype: fp32, bf16, fp16", {}),
    "compute_dtype": (str, "auto", COMPUTE_DTYPE_HELP, {}),
    "chat_template": (str, "auto", "prompts through the tokenizer's chat template: auto (when it has one), on, off",
                      {}),
    "split": (str, "test", "problems to use: test (reports) or validation (tuning)", {}),
    "arch": (str | None, None, ARCH_HELP, {}),
    "json": (str | None, None, "write results as JSON to this file", {}),
}


def shared(name: str, default: Any = dataclasses.MISSING, help: str | None = None, **extra) -> Any:
    """The field of the shared option `name` (`SHARED`), with this command's default and help where they differ
    (a `needs` rule or other `option` keywords in `extra`). The field's type must be SHARED's (a test checks)."""
    _, base_default, base_help, base_extra = SHARED[name]
    return option(base_default if default is dataclasses.MISSING else default, help or base_help,
                  **{**base_extra, **extra})


@dataclass
class EvalConfig(Config):
    """Options of `deltalens eval` (its MODELS are arguments)."""

    NAME: ClassVar[str] = "eval"

    task: str | None = shared("task")
    samples: int = shared("samples")
    k: str = shared("k")
    temperature: float = shared("temperature", 0.6)
    limit: int | None = shared("limit")
    json: str | None = shared("json")
    label: tuple[str, ...] = option((), "label per model (repeat)", repeat=True)
    data: str | None = shared("data")
    question_field: str = shared("question_field")
    answer_field: str = shared("answer_field")
    arch: str | None = shared("arch")
    dtype: str = shared("dtype")
    compute_dtype: str = shared("compute_dtype", needs=HF_ONLY)
    max_new_tokens: int | None = shared("max_new_tokens")
    seed: int = shared("seed")
    backend: str = shared("backend")
    chat_template: str = shared("chat_template")
    split: str | None = shared("split", None, "problems to use: test (reports) or validation (tuning) "
                                              "(default: test)")
    trained_on: str | None = option(None, "score the problems this run directory trained on (every iteration's "
                                          "prompts, up to its weights) instead of a split, with the run's task")
    device: str = shared("device", needs=HF_ONLY)
    log_samples: str | None = option(None, "write every completion as JSONL: one line per model x problem x "
                                           "sample (prompt, answer, completion, reward, correct)")


def check_eval_options(*, samples: int = 32, ks: str | Sequence[int] | None = None, temperature: float = 0.6,
                       limit: int | None = None, max_new_tokens: int | None = None) -> None:
    """Raise a one-line DeltalensError naming the first bad option; return None when all are valid."""
    if samples < 1:
        raise DeltalensError(f"--samples must be >= 1 (got {samples})")
    if limit is not None and limit < 1:
        raise DeltalensError(f"--limit must be >= 1 (got {limit}); omit it to evaluate every test problem")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise DeltalensError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    SamplingParams(n=samples, temperature=temperature)  # its own one-line errors
    if ks is not None:
        k = parse_ks(ks)
        if max(k) > samples:
            raise DeltalensError(f"--k {max(k)} exceeds --samples {samples}; raise --samples or lower --k")
