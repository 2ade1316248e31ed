"""Evaluate models on a task's test problems: sample, score, and summarise as Pass@K / Maj@K.

`evaluate` samples `samples` completions per problem through a generation backend and returns the
`evals` entry of analysis.json (docs/analysis-schema.md); `evaluate_models` does that for several model
specs and returns a whole analysis document. Defaults follow the paper: 32 samples at temperature 0.6,
K in {1, 16, 32}; `evaluate_models` fits Ks above the samples to them (`passk.fit_ks`, with a note) and
keeps the first 2 completions of every problem in `per_problem` (what a report shows as sample
completions; measured on tiny/arith: 0.15 KB per problem in the indented JSON, ~72 KB for 500 problems
per model; GSM8K-length completions of ~1 KB would make it ~1 MB).

Every generation pass records its throughput (`cost.record_rate`), which the plan line of the next
evaluation (`cost.plan_line`) turns into a time estimate. `on_samples(problems, completions)` sees
every completion (`deltalens eval --log-samples`, `deltalens.evaluation.samples`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from deltalens.errors import DeltalensError
from deltalens.evaluation.cost import record_rate
from deltalens.evaluation.passk import fit_ks, parse_ks, summarize
from deltalens.generation import HFBackend, SamplingParams, backend_for_spec
from deltalens.generation.dtype import machine
from deltalens.generation.prompts import problem_prompts
from deltalens.io.models import apply_state_dict, dtype_name, load_model
from deltalens.io.spec import default_labels
from deltalens.schema import new_document
from deltalens.tasks import Task, get_task


def evaluate(model, tokenizer, task: Task, *, samples: int = 32, ks: Sequence[int] = (1, 16, 32),
             temperature: float = 0.6, top_p: float = 1.0, limit: int | None = None,
             max_new_tokens: int | None = None, seed: int = 0, backend=None,
             progress: Callable[[int, int], None] | None = None, keep_completions: int = 0,
             split: str = "test", chat_template: str = "auto", problems: Sequence | None = None,
             model_spec: str | None = None, config: str | None = None,
             on_samples: Callable[[list, list[list[str]]], None] | None = None,
             compute_dtype: str = "fp32") -> dict:
    """Sample `samples` completions for each problem of a split (test: what evaluations report;
    validation: what tuning looks at) and score them (the `evals` schema entry). `problems` replaces the
    split (e.g. a run's own training problems, `deltalens.training.trained`; name them with `split`).

    The backend (default: HF with `chat_template` auto/on/off) decides the prompt form: chat messages
    or raw text (`deltalens.generation.prompts`). progress(done, total) is called as sequences finish
    (total = problems x samples). model_spec (and config, for bare weights): what the model was loaded
    from, which keys its measured rate (`cost`); without it, the loaded model's config does.
    on_samples(problems, completions) is called once with every completion (completions[i][j]).
    compute_dtype: of the default HF backend (fp32, bf16, auto: `deltalens.generation.dtype`).
    """
    problems = task.split(split, limit) if problems is None else list(problems)[:limit]
    if not problems:
        raise DeltalensError(f"task {task.name} has no {split} problems")
    ks = parse_ks(ks)
    backend = backend or HFBackend(model, tokenizer, chat_template=chat_template, compute_dtype=compute_dtype)
    params = SamplingParams(n=samples, temperature=temperature, top_p=top_p,
                            max_new_tokens=max_new_tokens or task.max_new_tokens, seed=seed,
                            stop=task.stop_strings(backend.chat))
    total = len(problems) * samples
    done = [0]

    def tick(k):
        done[0] += k
        if progress is not None:
            progress(done[0], total)

    t0 = time.time()
    completions = backend.generate(problem_prompts(problems, backend.chat), params, progress=tick)
    gen_s = time.time() - t0
    _record(model, backend, model_spec, config, params.max_new_tokens, total, gen_s)
    if on_samples is not None:
        on_samples(problems, completions)
    out = {"task": task.spec, "split": split, "n_problems": len(problems), "samples": samples,
           "temperature": temperature, "top_p": top_p, "seed": seed, "max_new_tokens": params.max_new_tokens,
           "chat_template": backend.chat}
    if params.stop:  # raw few-shot prompts: completions cut before the next example (`Task.stop_strings`)
        out["stop"] = list(params.stop)
    if isinstance(backend, HFBackend):  # what generation ran in (`auto` resolved): fp32, bf16, fp16
        out["compute_dtype"] = dtype_name(backend.dtype)
    out.update(summarize(task, problems, completions, ks, seed=seed, keep_completions=keep_completions))
    n_chars = sum(len(c) for comps in completions for c in comps)
    out["timing"] = {"generate_s": round(gen_s, 3), "sequences": total,
                     "completion_chars_per_s": round(n_chars / max(gen_s, 1e-9), 1), "machine": _machine(model)}
    return out


def _first_param(model):
    """The model's first parameter, or None (no model, or one without torch parameters: vLLM's)."""
    return next(model.parameters(), None) if model is not None and hasattr(model, "parameters") else None


def _machine(model) -> str:
    """`dtype.machine` of the device the model's weights are on (vLLM, which places its own: the CPU's or
    GPU 0's)."""
    param = _first_param(model)
    return machine(param.device if param is not None else "cuda" if torch.cuda.is_available() else "cpu")


def _record(model, backend, spec, config, max_new_tokens, sequences, seconds) -> None:
    """The throughput of this pass, for later plan lines (never raises: `record_rate`), keyed by the dtype
    generation ran in: the HF backend's compute dtype, else the weights'."""
    name = "hf" if isinstance(backend, HFBackend) else \
        "vllm" if type(backend).__name__.startswith("VLLM") else type(backend).__name__
    param = _first_param(model)
    device = None if param is None else param.device.type
    dtype = dtype_name(backend.dtype) if isinstance(backend, HFBackend) else \
        "fp32" if param is None else dtype_name(param.dtype)  # what generation ran in (`cost.generation_dtype`)
    record_rate(model=spec if spec is not None else model, backend=name, max_new_tokens=max_new_tokens,
                sequences=sequences, seconds=seconds, dtype=dtype, device=device, config=config)


def evaluate_state_dict(base_model_spec: str, state_dict: dict[str, torch.Tensor], task: str | Task, *,
                        samples: int = 32, ks: Sequence[int] = (1, 16, 32), temperature: float = 0.6,
                        limit: int | None = None, seed: int = 0, model_cache: dict | None = None,
                        chat_template: str = "auto", backend=None, progress=None,
                        compute_dtype: str = "fp32") -> dict:
    """Evaluate `state_dict` applied onto the architecture (and tokenizer) of `base_model_spec`.

    Pass a dict as `model_cache` to reuse one loaded model across calls (sparsification sweeps). Or pass a
    running vLLM `backend` of `base_model_spec` (`VLLMBackend`): the state dict is loaded into its engine
    (`load_state_dict`) and sampled there; the engine keeps these weights afterwards.
    """
    t = get_task(task) if isinstance(task, str) else task
    if backend is not None:
        if model_cache is not None:
            raise DeltalensError("evaluate_state_dict: pass a vLLM backend or a model_cache, not both")
        # the backend's own chat setting decides the prompt form (it was built with one)
        backend.load_state_dict(state_dict)
        return evaluate(None, backend.tok, t, samples=samples, ks=ks, temperature=temperature, limit=limit,
                        seed=seed, chat_template=chat_template, backend=backend, progress=progress,
                        model_spec=base_model_spec)
    if model_cache is not None and base_model_spec in model_cache:
        model, tok = model_cache[base_model_spec]
    else:
        model, tok = load_model(base_model_spec)
        if model_cache is not None:
            model_cache[base_model_spec] = (model, tok)
    apply_state_dict(model, state_dict, source="state dict")
    return evaluate(model, tok, t, samples=samples, ks=ks, temperature=temperature, limit=limit, seed=seed,
                    chat_template=chat_template, progress=progress, model_spec=base_model_spec,
                    compute_dtype=compute_dtype)


def evaluate_models(specs: Sequence[str], task: Task, *, labels: Sequence[str] | None = None,
                    config: str | None = None, dtype: str = "fp32", samples: int = 32,
                    ks: Sequence[int] = (1, 16, 32), temperature: float = 0.6, limit: int | None = None,
                    max_new_tokens: int | None = None, seed: int = 0, backend: str = "hf",
                    chat_template: str = "auto", progress_factory=None, device: str = "auto",
                    split: str = "test", problems: Sequence | None = None, keep_completions: int = 2,
                    on_samples: Callable[[str, list, list[list[str]]], None] | None = None,
                    log: Callable[[str], None] | None = None, compute_dtype: str = "fp32") -> dict:
    """Evaluate each model on `task`; returns an analysis.json-shaped dict with `models` and `evals`.

    device: where the HF backend runs the model (cpu, cuda, cuda:N, auto); vLLM places its own.
    compute_dtype: what the HF backend generates in (fp32, bf16, auto: `deltalens.generation.dtype`).
    problems: score these instead of the split (`split` then names them, e.g. "trained").
    Ks above `samples` become `samples` (`fit_ks`); the note saying so goes to `log`.
    keep_completions: completions kept per problem in `per_problem` (for reports).
    on_samples(label, problems, completions): every completion of each model, once its pass is done.

    progress_factory(label, total) -> callable(done, total), or None for no progress reporting.
    """
    ks, note = fit_ks(parse_ks(ks), samples)
    if note and log is not None:
        log(note)
    if labels is not None and len(labels) != len(specs):
        raise DeltalensError(f"got {len(labels)} labels for {len(specs)} models; give one --label per model")
    labels = list(labels) if labels else default_labels(list(specs))
    result = new_document(None, [], evals={})
    for spec, label in zip(specs, labels):
        be, model, tok = backend_for_spec(backend, spec, dtype=dtype, config=config, device=device,
                                          chat_template=chat_template, compute_dtype=compute_dtype,
                                          in_place=True)  # only generation: no fp32 copy kept beside bf16
        n = len(task.split(split, limit) if problems is None else list(problems)[:limit])
        prog = progress_factory(label, n * samples) if progress_factory else None
        try:
            res = evaluate(model, tok, task, samples=samples, ks=ks, temperature=temperature, limit=limit,
                           max_new_tokens=max_new_tokens, seed=seed, backend=be, progress=prog, split=split,
                           problems=problems, keep_completions=keep_completions, model_spec=spec, config=config,
                           on_samples=None if on_samples is None else
                           (lambda ps, comps, _label=label: on_samples(_label, ps, comps)))
        finally:
            if hasattr(be, "close"):
                be.close()  # frees the GPU before the next model
        res["model"] = spec
        result["models"].append({"label": label, "path": spec, "kind": "checkpoint", "method": None})
        result["evals"][label] = res
        del model
    return result
