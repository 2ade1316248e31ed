"""The analysis.json `diversity` section (docs/analysis-schema.md) of one model or ES run, and its document.

`diversity_section` loads the population (`populations.load_population`), runs the estimate
(`divergence.population_divergence`) and, with `sweep`, the σ sweep (`sweep.sigma_sweep`), and returns
the schema's entry: its JS is the reported estimator, named in `estimator`
(`deltalens.analysis.diversity.estimators`). Additions beside the schema's keys: `cost`, `timing`, `notes`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from deltalens.analysis.diversity.divergence import Progress, population_divergence
from deltalens.analysis.diversity.estimators import ESTIMATOR
from deltalens.analysis.diversity.populations import load_population
from deltalens.analysis.diversity.sweep import sigma_sweep
from deltalens.analysis.document import analysis_document, model_entry
from deltalens.errors import DeltalensError
from deltalens.io.runs import RunDir
from deltalens.io.spec import ModelRef, default_labels, resolve
from deltalens.tasks import get_task


def diversity_section(model_spec: str | ModelRef, task, *, members: int | None = None, sigma: float | None = None,
                      iteration: int | None = None, prompts: int = 16, samples: int = 4,
                      temperature: float = 0.6, seed: int = 0, progress: Progress | None = None,
                      sweep: Sequence[float] | None = None, fisher_samples: int = 32,
                      max_new_tokens: int | None = None, centre_samples: int | None = None,
                      dtype: str | None = None, chat_template="auto", config: str | None = None) -> dict:
    """One `diversity` entry of analysis.json (docs/analysis-schema.md) for a model or an ES run.

    members / sigma: None = the run's (with `iteration`) else 32 / 1.5e-3; sigma = 0 gives N copies of
    the centre. `prompts` first test problems of `task` (a Task or a task name), `samples` responses per
    member and prompt at `temperature`. `sweep`: σ values for an optional `sigma_sweep` (same noise).
    progress(done, total, stage) is called as members are sampled and scored.
    """
    t = get_task(task) if isinstance(task, str) else task
    problems = t.test(prompts)
    if not problems:
        raise DeltalensError(f"task {t.name} has no test problems")
    pop, info = load_population(model_spec, t, members=members, sigma=sigma, iteration=iteration, seed=seed,
                                dtype=dtype, chat_template=chat_template, config=config)
    chat_template = pop.config.chat_template  # an ES run's own setting
    n_sweep = len(sweep or ())
    grand = 2 * pop.size + 1 + (1 + n_sweep * 3 * pop.size if n_sweep else 0)
    offset = [0]

    def prog(done, total, stage):
        if progress is not None:
            progress(offset[0] + done, grand, stage)

    t0 = time.perf_counter()
    try:
        res = population_divergence(pop, t, problems, samples=samples, temperature=temperature,
                                    max_new_tokens=max_new_tokens, seed=seed, centre_samples=centre_samples,
                                    progress=prog, chat_template=chat_template)
    finally:
        pop.close()
    offset[0] = 2 * pop.size + 1
    section = {"estimator": ESTIMATOR, "sigma": pop.sigma, "members": pop.size, "prompts": len(problems),
               "samples": samples,
               "temperature": temperature, "max_new_tokens": max_new_tokens or t.max_new_tokens, "task": t.spec,
               "seed": seed, **info, **res}
    if n_sweep:
        section["sigma_sweep"] = sigma_sweep(
            pop.model, pop.tokenizer, t, list(sweep), config=pop.config, iteration=pop.iteration,
            prompts=prompts, samples=samples, temperature=temperature, seed=seed, fisher_samples=fisher_samples,
            max_new_tokens=max_new_tokens, progress=prog, chat_template=chat_template)
    section["timing"] = {**res["timing"], "total_s": round(time.perf_counter() - t0, 3)}
    return section


def diversity_analysis(model_spec: str | ModelRef, task, *, label: str | None = None, **options) -> dict:
    """An analysis.json document (schema_version, base, models, diversity) for one model or ES run.

    The spec is resolved once (`deltalens.io.spec.resolve`; a `ModelRef` is taken as it is) and the reference
    passed down. base is the run's base model for a run directory, else the model itself; options go to
    `diversity_section`.
    """
    ref = resolve(model_spec)
    label = label or default_labels([ref.spec])[0]
    base = ref.spec if ref.run is None else str(RunDir(ref.run).config().get("model", ref.spec))
    section = diversity_section(ref, task, **options)
    return analysis_document(base, [model_entry(label, ref)], diversity={label: section})
