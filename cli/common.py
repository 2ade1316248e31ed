"""Options shared by several commands (defined once), error handling, and progress bars."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from deltalens.errors import DeltalensError

console = Console(stderr=True)

# ---- shared options
Task = Annotated[str | None, typer.Option("--task", "-t", help="task spec: arith, add:digits=2,terms=3, countdown, "
                                         "gsm8k, jsonl, ... (default: the model's own, else arith)")]
Data = Annotated[str | None, typer.Option("--data", help="jsonl file or directory (gsm8k, jsonl tasks)")]
QuestionField = Annotated[str, typer.Option("--question-field", help="jsonl task: question field name")]
AnswerField = Annotated[str, typer.Option("--answer-field", help="jsonl task: answer field name")]
Samples = Annotated[int, typer.Option("--samples", "-n", help="samples per problem")]
Ks = Annotated[str, typer.Option("--k", help="comma-separated K values for Pass@K / Maj@K")]
Temperature = Annotated[float, typer.Option("--temperature", help="sampling temperature (0 = greedy)")]
Limit = Annotated[int | None, typer.Option("--limit", help="evaluate only the first N test problems")]
Seed = Annotated[int, typer.Option("--seed", help="random seed")]
Config = Annotated[str | None, typer.Option("--config", help="architecture for bare .pt/.safetensors weights")]
Dtype = Annotated[str, typer.Option("--dtype", help="model dtype: fp32, bf16, fp16")]
JsonOut = Annotated[Path | None, typer.Option("--json", help="write results as JSON to this file")]
MaxNewTokens = Annotated[int | None, typer.Option("--max-new-tokens", help="generation budget (default: task's)")]
Backend = Annotated[str, typer.Option("--backend", help="generation backend: hf, or vllm (GPU or CPU build; docs/vllm.md)")]
Device = Annotated[str, typer.Option("--device", help="where the HF backend runs the model: cpu, cuda, cuda:N, auto")]
ChatTemplate = Annotated[str, typer.Option("--chat-template", help="prompts through the tokenizer's chat template: "
                                           "auto (when it has one), on, off")]
Split = Annotated[str, typer.Option("--split", help="problems to use: test (reports) or validation (tuning)")]


def guard(fn):
    """Turn DeltalensError into a one-line message and exit 2 (full traceback with DELTALENS_DEBUG=1)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DeltalensError as e:
            if os.environ.get("DELTALENS_DEBUG") == "1":
                raise
            console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=2) from None
        except KeyboardInterrupt:
            console.print("interrupted")
            raise typer.Exit(code=130) from None

    return wrapper


def progress_bar(transient: bool = False) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                    console=console, transient=transient, disable=not sys.stderr.isatty() and
                    os.environ.get("DELTALENS_PROGRESS") != "1")


def bar_factory(bar: Progress, prefix: str = ""):
    """progress_factory(desc, total) -> progress(done, total=None): one task of `bar` per call."""

    def factory(desc, total):
        tid = bar.add_task(prefix + desc, total=total)
        return lambda done, _total=None: bar.update(tid, completed=done)

    return factory


def parse_floats(text: str, what: str) -> list[float]:
    """'2.5e-4,5e-4' -> [0.00025, 0.0005] with a one-line error naming the option."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DeltalensError(f"{what} must be comma-separated numbers like 2.5e-4,5e-4 (got {text!r})") from None
    if not vals:
        raise DeltalensError(f"{what} is empty")
    return vals
