"""`deltalens train`: fine-tune a model with ES (and later GRPO, ES->GRPO) into a run directory.

    deltalens train --method es --model tiny --task arith --out runs/es --iterations 30
    deltalens train --method es --resume runs/es                       # continue a killed run
    deltalens train --method es --model tiny --out runs/es-ray --backend ray --workers 2
    deltalens train --method es --model tiny --out runs/es-lr --noise lowrank --rank 1 --population-batch 32

`--method` dispatches through `METHODS`, a name -> trainer dict. A trainer is called as
`trainer(opts, progress) -> Path` with `opts` a dict of every option of `train` (None where the user
gave none) and `progress(done, total, row)` a callback that drives the progress bar (row: the metrics
row with reward_mean/reward_max/timing.iteration_s, or None). A value may be a "module:function"
string, imported only when that method is used, so `deltalens.grpo` provides `train_cli` for "grpo"
(and can provide `train_es_grpo_cli` for "es-grpo") without this file importing it. Options a method
needs beyond the ones below (e.g. GRPO's learning rate) are added to `train`'s signature; trainers
read them from `opts` with .get() and ignore the rest.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from deltalens.errors import DeltalensError

from . import common as c

Trainer = Callable[[dict, Callable], Path]


def _train_es(opts: dict[str, Any], progress) -> Path:
    """ES: build an ESConfig from the preset + the options given, or from the run being resumed."""
    from deltalens.es import ESConfig, train_es
    from deltalens.runs import RunDir

    fields = {"model": "model", "task": "task", "data": "data", "question_field": "question_field",
              "answer_field": "answer_field", "population": "population", "sigma": "sigma", "alpha": "alpha",
              "prompts_per_iteration": "prompts", "temperature": "temperature",
              "max_new_tokens": "max_new_tokens", "antithetic": "antithetic", "fitness": "fitness",
              "params": "params", "dtype": "dtype", "restore": "restore", "iterations": "iterations",
              "eval_every": "eval_every", "eval_limit": "eval_limit", "checkpoint_every": "checkpoint_every",
              "seed": "seed", "backend": "backend", "workers": "workers", "save_pt": "save_pt",
              "noise": "noise", "rank": "rank", "population_batch": "population_batch", "device": "device"}
    given = {f: opts[o] for f, o in fields.items() if opts.get(o) is not None}
    if opts.get("resume") is not None:
        # the run's own settings, with whatever was passed on top (train_es refuses trajectory changes)
        stored = ESConfig.from_dict(RunDir(opts["out"]).config()).to_dict()
        stored.pop("method")
        config = ESConfig(**{**stored, **given})
        return train_es(config, opts["out"], resume=True, progress=progress)
    preset = opts.get("preset") or "auto"
    if preset == "auto":
        preset = "tiny" if given.get("model", "tiny") == "tiny" else "paper"
    config = ESConfig.preset(preset, **given)
    return train_es(config, opts["out"], resume=False, progress=progress, overwrite=bool(opts.get("overwrite")))


METHODS: dict[str, Trainer | str] = {
    "es": _train_es,
    "grpo": "deltalens.grpo:train_cli",
    "es-grpo": "deltalens.sequence:train_cli",
    "grpo-es": "deltalens.sequence:train_cli",
}


def resolve_method(name: str) -> Trainer:
    """The trainer for `--method name` (imports "module:function" entries on first use)."""
    if name not in METHODS:
        raise DeltalensError(f"unknown --method {name!r}; choose one of {', '.join(METHODS)}")
    fn = METHODS[name]
    if isinstance(fn, str):
        module, attr = fn.split(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            raise DeltalensError(f"--method {name} is not available in this version ({fn} is missing); "
                                 "use --method es") from None
    return fn


def train(
    method: Annotated[str, typer.Option("--method", "-m", help="training method: es, grpo, es-grpo, grpo-es")] = "es",
    model: Annotated[str | None, typer.Option("--model", help="base model: tiny, HF dir, run dir, .gguf, hub id")] = None,
    task: Annotated[str | None, typer.Option("--task", "-t", help="task: arith, countdown, gsm8k, jsonl, ...")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="run directory to create")] = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="continue the run in this directory")] = None,
    iterations: Annotated[int | None, typer.Option("--iterations", help="ES iterations (total, also on resume)")] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="GRPO optimizer steps")] = None,
    budget: Annotated[str | None, typer.Option("--budget", help="FLOP-matched units (e.g. 2e6, 1.5M): sets iterations/steps; ES 2N, GRPO 8G per prompt")] = None,
    es_fraction: Annotated[float | None, typer.Option("--es-fraction", help="es-grpo/grpo-es: share of --budget for the ES stage (default 0.5)")] = None,
    init_from: Annotated[str | None, typer.Option("--init-from", help="start from this checkpoint / run dir (GRPO; the architecture is --model's)")] = None,
    num_generations: Annotated[int | None, typer.Option("--num-generations", "-G", help="GRPO group size G")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="GRPO learning rate")] = None,
    lr_scheduler: Annotated[str | None, typer.Option("--lr-scheduler", help="GRPO LR schedule: constant, linear, cosine, ...")] = None,
    beta: Annotated[float | None, typer.Option("--beta", help="GRPO KL coefficient β (k3)")] = None,
    epsilon: Annotated[float | None, typer.Option("--epsilon", help="GRPO clip range ε")] = None,
    loss_type: Annotated[str | None, typer.Option("--loss-type", help="GRPO loss: grpo, dr_grpo, dapo, bnpo")] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", help="GRPO per-device micro batch (completions)")] = None,
    use_vllm: Annotated[bool | None, typer.Option("--use-vllm/--no-use-vllm", help="GRPO generation through TRL's vLLM path (GPUs)")] = None,
    save_pt: Annotated[bool | None, typer.Option("--save-pt/--no-save-pt", help="also save a .pt state dict per checkpoint")] = None,
    backend: Annotated[str | None, typer.Option("--backend", help="member evaluation: local, ray, or vllm (GPUs)")] = None,
    workers: Annotated[int | None, typer.Option("--workers", help="ray backend: actors (model replicas)")] = None,
    preset: Annotated[str | None, typer.Option("--preset", help="ES hyperparameter preset: auto (tiny for the tiny model, else paper), tiny, paper")] = None,
    population: Annotated[int | None, typer.Option("--population", "-N", help="ES population size N")] = None,
    sigma: Annotated[float | None, typer.Option("--sigma", help="ES noise scale")] = None,
    alpha: Annotated[float | None, typer.Option("--alpha", help="ES step size")] = None,
    prompts: Annotated[int | None, typer.Option("--prompts", help="training prompts per iteration")] = None,
    temperature: Annotated[float | None, typer.Option("--temperature", help="training decoding temperature (0 = greedy)")] = None,
    max_new_tokens: c.MaxNewTokens = None,
    antithetic: Annotated[bool | None, typer.Option("--antithetic/--no-antithetic", help="mirrored noise pairs")] = None,
    fitness: Annotated[str | None, typer.Option("--fitness", help="reward shaping: zscore or centered_rank")] = None,
    params: Annotated[str | None, typer.Option("--params", help="comma-separated globs of parameters to train; !glob excludes")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="weight dtype: fp32, bf16, fp16")] = None,
    restore: Annotated[str | None, typer.Option("--restore", help="after each member: copy (exact) or subtract (less memory)")] = None,
    noise: Annotated[str | None, typer.Option("--noise", help="ES noise: full (dense) or lowrank (EGGROLL rank-r on 2-D weights)")] = None,
    rank: Annotated[int | None, typer.Option("--rank", help="ES lowrank noise: rank r")] = None,
    population_batch: Annotated[int | None, typer.Option("--population-batch", help="ES members per batched generation (0 = one by one)")] = None,
    device: Annotated[str | None, typer.Option("--device", help="where the model trains: cpu, cuda (ES also cuda:N, auto)")] = None,
    eval_every: Annotated[int | None, typer.Option("--eval-every", help="held-out greedy Pass@1 every k iterations (0 = never)")] = None,
    eval_limit: Annotated[int | None, typer.Option("--eval-limit", help="test problems in that evaluation")] = None,
    checkpoint_every: Annotated[int | None, typer.Option("--checkpoint-every", help="checkpoint every k iterations")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="run seed (prompts and noise)")] = None,
    data: c.Data = None,
    question_field: Annotated[str | None, typer.Option("--question-field", help="jsonl task: question field name")] = None,
    answer_field: Annotated[str | None, typer.Option("--answer-field", help="jsonl task: answer field name")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing run in --out")] = False,
):
    """Fine-tune a model (ES, GRPO, or one then the other) into a run directory: config.json,
    metrics.jsonl, HF checkpoints. Options a method does not use are ignored."""
    if resume is not None:
        if out is not None and Path(out).resolve() != Path(resume).resolve():
            raise DeltalensError(f"--out {out} and --resume {resume} differ; pass only --resume {resume}")
        out = resume
    if out is None:
        raise DeltalensError("pass --out DIR for a new run (or --resume DIR to continue one)")
    opts = {k: v for k, v in locals().items() if k not in ("method",)}
    opts["out"] = out
    opts["method"] = method
    for absent in ("autocast", "gradient_checkpointing"):  # GRPO fields with no flag (yet)
        opts.setdefault(absent, None)
    trainer = resolve_method(method)
    with c.progress_bar() as bar:
        tid = bar.add_task(f"{method}", total=None)

        def progress(done: int, total: int, row: dict | None) -> None:
            desc = f"{method} it {done}/{total}"
            if row is not None:
                desc += (f"  reward {row['reward_mean']:.3f} (max {row['reward_max']:.3f})"
                         f"  {row['timing']['iteration_s']:.1f} s/it")
                if "eval" in row:
                    desc += f"  pass@1 {row['eval']['pass_at_1']:.3f}"
            bar.update(tid, completed=done, total=total, description=desc)

        run_dir = trainer(opts, progress)
    _summary(Path(run_dir))


def _summary(run_dir: Path) -> None:
    from deltalens.runs import RunDir

    rows = RunDir(run_dir).metrics()
    train_rows = [r for r in rows if "reward_mean" in r]
    evals = [(r["iteration"], r["eval"]["pass_at_1"]) for r in rows if "eval" in r]
    msg = f"run: {run_dir}"
    if train_rows:
        last = train_rows[-1]
        msg += f"  iterations {last['iteration']}  reward {train_rows[0]['reward_mean']:.3f} -> {last['reward_mean']:.3f}"
    if evals:
        msg += f"  held-out pass@1 {evals[0][1]:.3f} (it {evals[0][0]}) -> {evals[-1][1]:.3f} (it {evals[-1][0]})"
    c.console.print(msg, highlight=False)
    typer.echo(str(run_dir))
