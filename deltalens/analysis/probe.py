"""`deltalens probe`: before hours of training, can RL move this model on this task at all?

ES and GRPO learn only from reward *differences*: ES z-scores the rewards of a population (all equal:
z = 0, no update), GRPO normalises rewards within a group of G samples of one prompt (all equal:
advantage 0, no gradient). The probe measures, on the validation split (presets and tuning look there,
never at test):

- sampled Pass@1 / Pass@G / Pass@K, mean reward and the format rate (share of completions in the stated
  `#### <answer>` form, the 0.1 reward) at each of `temperatures` (default PROBE_TEMPERATURES: the paper's
  evaluation temperature 0.6 and GRPO's training temperature 1.0), with the whole Pass@K / Maj@K curve
  (K = 1..samples) of each: a base that looks weak at 0.6 may solve as much at 1.0, which is what a trained
  model's Pass@K is later compared with;
- greedy Pass@1 (ES decodes greedily);
- GRPO signal: the share of groups (G consecutive samples of one prompt) whose rewards are not all equal, at
  each temperature; the verdict, the headline Pass@K / mean reward / format rate and the examples are the
  signal temperature's (`signal_temperature`: GRPO's 1.0 when probed, else the first listed);
- ES signal: `es_populations` populations of `es_members` perturbed models (the model's ES preset σ,
  antithetic and noise family as the preset says) scored greedily on `es_prompts` training prompts each,
  through the local backend `deltalens train es` uses, and the share of populations whose member rewards
  are not all equal. Members are scored one by one even where the preset batches them: a batch of 8
  members holds 8 members' KV cache (peaks in benchmarks/README.md), and greedy rewards do not depend on
  the batching (`deltalens.training.es.population`);

and ends in a one-line verdict. It is a cheap necessary condition, not a promise that training helps.

`backend="vllm"` runs the sampled and greedy passes through a vLLM engine (3-4x HF's tokens/s for
SmolLM2 on 2 CPU cores, docs/vllm.md); the ES populations always score on HF, as `deltalens train es`
(local backend) decodes them, so their greedy rewards match training's. vLLM seeds its own sampler: the
same `seed` draws other samples than HF does (same distribution), and its greedy decoding can differ
from HF's on near-ties (different kernels).

Memory: the sampled pass keeps only completion strings and rewards (the strings of the signal
temperature only: the others are summarised and dropped); its batches hold at most the HF
backend's token budget of KV cache (`deltalens.generation.batching`: 512 MiB by default), so peak memory
does not grow with limit x samples (before that budget, 50 x 16 on SmolLM2 went into one batch of 800
rows and peaked at 7.2 GB resident). `compute_dtype` is the HF passes' and the ES populations'
(`deltalens.generation.dtype`; for ES, `ESConfig.compute_dtype`'s rule: with bf16 compute each member is
written into the bf16 copy and the fp32 weights are never perturbed, so no restore copy of them is
taken). With bf16 compute the HF passes need no fp32 weights: the loaded model is cast in place
(`cast_in_place`, the bits of the bf16 copy) and the ES populations load the fp32 weights again: one more
load for the fp32 weights' memory while sampling. benchmarks/README.md has the measured peaks.

Every numeric and named setting is checked up front (`check_probe_options`), before a task's data is read
or a model loads, with a one-line error naming the option: a group must hold at least two samples (one
sample has no spread) and cut the samples evenly, a population at least two members, σ must be a positive
finite number.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from deltalens.analysis.options import PROBE_TEMPERATURES
from deltalens.errors import DeltalensError
from deltalens.evaluation.passk import summarize
from deltalens.generation import BACKENDS, SamplingParams, backend_for_spec
from deltalens.generation.dtype import check_compute_dtype
from deltalens.generation.prompts import CHAT_MODES, problem_prompts
from deltalens.io.models import load_model, torch_dtype
from deltalens.tasks import Task
from deltalens.training.es.backends.local import LocalBackend
from deltalens.training.es.config import ESConfig
from deltalens.training.es.engine import ESEngine
from deltalens.training.es.strategy import iteration_problems

Progress = Callable[[str], None]
GRPO_TEMPERATURE = 1.0  # the GRPO signal's temperature when probed (GRPO samples its groups at 1.0)


def _distinct(values) -> bool:
    return len(set(values)) > 1


def verdict(grpo_share: float, es_share: float | None) -> str:
    """The one-line verdict from the shares of groups / populations with unequal rewards."""
    es_ok = es_share is not None and es_share > 0
    if grpo_share > 0 and es_ok:
        return "ES and GRPO have signal"
    if grpo_share > 0 and es_share is None:
        return "GRPO has signal (ES not probed: --es-populations 0)"
    if grpo_share > 0:
        return "GRPO has signal; ES populations scored alike: raise --sigma or the prompts per iteration"
    if es_ok:
        return "ES has signal; GRPO groups scored alike: raise the temperature or the group size"
    return "reward is constant: pick an easier task or another model"


def signal_temperature(temperatures: Sequence[float]) -> float:
    """The temperature of the GRPO signal, the verdict and the headline numbers: GRPO's 1.0 when probed, else
    the first listed."""
    return GRPO_TEMPERATURE if GRPO_TEMPERATURE in temperatures else temperatures[0]


def probe_temperatures(temperature: float | None, temperatures: Sequence[float] | None) -> tuple[float, ...]:
    """Every temperature the sampled pass runs at: `temperatures`, else the one `temperature`, else
    PROBE_TEMPERATURES."""
    if temperatures is not None:
        return tuple(temperatures)
    return (temperature,) if temperature is not None else PROBE_TEMPERATURES


def _temperature_ok(t) -> bool:
    return isinstance(t, (int, float)) and math.isfinite(t) and t >= 0


def check_probe_options(*, limit: int | None = 200, samples: int = 32, group: int = 8,
                        temperature: float | None = None, temperatures: Sequence[float] | None = None,
                        max_new_tokens: int | None = None, chat_template: str = "auto", es_members: int = 8,
                        es_prompts: int = 16, es_populations: int = 2, es_sigma: float | None = None,
                        seed: int = 0, backend: str = "hf") -> None:
    """Refuse (one DeltalensError naming the option) any setting `probe` would crash on or silently misread;
    it reads no data and loads nothing, so commands call it first."""
    if limit is not None and limit < 1:
        raise DeltalensError(f"--limit must be >= 1 (got {limit})")
    if samples < 1:
        raise DeltalensError(f"--samples must be >= 1 (got {samples})")
    # group before the divisibility test: --group 0 would divide by zero there
    if group < 2:
        raise DeltalensError(f"--group must be >= 2 (got {group}): a group of one has no spread")
    if group > samples:
        raise DeltalensError(f"--group {group} exceeds --samples {samples} (groups are cut from each prompt's "
                             "samples); raise --samples or lower --group")
    if samples % group:
        raise DeltalensError(f"--samples {samples} must be a multiple of --group {group} (groups are cut from "
                             "each prompt's samples)")
    if temperature is not None and not _temperature_ok(temperature):
        raise DeltalensError(f"--temperature must be a finite number >= 0 (got {temperature}); 0 is greedy")
    if temperatures is not None:
        shown = ",".join(f"{t:g}" if isinstance(t, (int, float)) else repr(t) for t in temperatures)
        if not temperatures or not all(_temperature_ok(t) for t in temperatures):
            raise DeltalensError(f"--temperatures must be finite numbers >= 0 (got {shown or 'none'}); 0 is greedy")
        if len(set(temperatures)) != len(temperatures):
            raise DeltalensError(f"--temperatures lists a temperature twice (got {shown})")
        if temperature is not None and temperature not in temperatures:  # the library's pair: one is the signal's
            raise DeltalensError(f"the signal temperature {temperature:g} must be one of the temperatures ({shown})")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise DeltalensError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    if seed < 0:  # numpy's generators (the bootstrap of Pass@K) take no negative seed
        raise DeltalensError(f"--seed must be >= 0 (got {seed})")
    if chat_template not in CHAT_MODES:
        raise DeltalensError(f"--chat-template must be auto, on or off (got {chat_template!r})")
    if backend not in BACKENDS:
        raise DeltalensError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if es_populations < 0:
        raise DeltalensError(f"--es-populations must be >= 0 (got {es_populations}); 0 skips ES")
    if es_populations == 0:
        return  # the ES settings are unused
    if es_members < 2:
        raise DeltalensError(f"--es-members must be >= 2 (got {es_members}): a population of one has no spread")
    if es_prompts < 1:
        raise DeltalensError(f"--es-prompts must be >= 1 (got {es_prompts})")
    # 0 must not fall back to the preset's sigma unnoticed, nor NaN reach the noise
    if es_sigma is not None and not (math.isfinite(es_sigma) and es_sigma > 0):
        raise DeltalensError(f"--es-sigma must be a finite number > 0 (got {es_sigma}); omit it for the preset's")


def probe(model_spec: str, task: Task, *, split: str = "validation", limit: int = 200, samples: int = 32,
          group: int = 8, temperature: float | None = None, temperatures: Sequence[float] | None = None,
          max_new_tokens: int | None = None, chat_template="auto",
          es_preset: str = "paper", es_members: int = 8, es_prompts: int = 16, es_populations: int = 2,
          es_sigma: float | None = None, seed: int = 0, dtype: str = "fp32", backend: str = "hf",
          log: Progress = lambda s: None, progress_factory=None, compute_dtype: str = "fp32") -> dict:
    """The probe section (see module docstring) for `model_spec` on `task`. Sampled at every one of
    `temperatures` (`probe_temperatures`: default PROBE_TEMPERATURES, or the one `temperature`); with both
    given, `temperature` is the signal temperature and must be listed, else it is `signal_temperature`'s.
    compute_dtype: what the HF backend's sampled and greedy passes generate in (fp32, bf16, auto:
    `deltalens.generation.dtype`)."""
    check_probe_options(limit=limit, samples=samples, group=group, temperature=temperature,
                        temperatures=temperatures, max_new_tokens=max_new_tokens, chat_template=chat_template,
                        es_members=es_members, es_prompts=es_prompts, es_populations=es_populations,
                        es_sigma=es_sigma, seed=seed, backend=backend)
    temps = probe_temperatures(temperature, temperatures)
    signal_t = temperature if temperature is not None and temperatures is not None else signal_temperature(temps)
    check_compute_dtype(compute_dtype)
    problems = task.split(split, limit)  # before any model loads: bad settings fail fast
    max_new = max_new_tokens or task.max_new_tokens
    cfg = None
    if es_populations > 0:
        # members one by one whatever the preset batches (memory over speed: module doc)
        cfg = ESConfig.preset(es_preset, model=model_spec, population=es_members, population_batch=0,
                              prompts_per_iteration=es_prompts, max_new_tokens=max_new_tokens, seed=seed,
                              chat_template=chat_template, compute_dtype=compute_dtype,
                              **({"sigma": es_sigma} if es_sigma is not None else {}))
        if cfg.antithetic and es_members % 2:
            raise DeltalensError(f"the {es_preset} ES preset uses antithetic pairs: --es-members must be even")
    t0 = time.perf_counter()
    # vLLM loads its own weights (model None); the HF copy is then loaded only for the ES populations
    gen, model, tok = backend_for_spec(backend, model_spec, dtype=dtype, device="cpu", chat_template=chat_template,
                                       compute_dtype=compute_dtype, in_place=True)  # no second copy (module doc)
    if model is not None and next(model.parameters()).dtype != torch_dtype(dtype):
        model = None  # cast for the passes: the ES populations load the loaded weights again
    try:
        sampled, greedy, comps, prompts = _passes(gen, task, problems, samples, group, temps, signal_t, max_new,
                                                  seed, log, progress_factory)
    finally:
        if hasattr(gen, "close"):
            gen.close()  # frees the engine (and its KV cache) before the HF model loads
    chat, gen = gen.chat, None  # the backend (and a bf16 compute copy) is not needed for the ES populations
    main = next(s for s in sampled if s["temperature"] == signal_t)
    rewards = main.pop("rewards")
    for s in sampled:
        s.pop("rewards", None)

    es = None
    if cfg is not None:
        if model is None:
            model, tok = load_model(model_spec, dtype=dtype)
        engine = ESEngine(model, tok, task, cfg)
        members = LocalBackend(engine)  # one by one or population-batched, as `train es` evaluates them
        pops = []
        try:
            for it in range(1, es_populations + 1):
                log(f"ES population {it}/{es_populations}: {es_members} members x {es_prompts} prompts")
                rewards_it, _ = members.evaluate(it, iteration_problems(task, cfg, it))
                pops.append(rewards_it)
        finally:
            engine.close()
        es = {"members": es_members, "prompts": es_prompts, "sigma": cfg.sigma, "preset": es_preset,
              "compute_dtype": engine.compute_dtype, "population_batch": cfg.population_batch,
              "populations": len(pops), "rewards": pops,
              "share_with_signal": sum(_distinct(p) for p in pops) / len(pops),
              "mean_reward_std": sum((sum((x - sum(p) / len(p)) ** 2 for x in p) / len(p)) ** 0.5
                                     for p in pops) / len(pops)}
    out = {
        "model": model_spec, "task": task.spec, "split": split, "n_problems": len(problems),
        "chat_template": chat, "backend": backend, "temperature": signal_t, "temperatures": list(temps),
        "samples": samples, "group": group, "max_new_tokens": max_new, "seed": seed,
        "pass_at_k": main["pass_at_k"], "maj_at_k": main["maj_at_k"], "mean_reward": main["mean_reward"],
        "format_rate": main["format_rate"], "greedy_pass_at_1": greedy["pass_at_k"]["1"],
        "greedy_mean_reward": greedy["mean_reward"],
        "grpo": {"group": group, "groups": main["grpo_groups"], "share_with_signal": main["grpo_share_with_signal"],
                 "temperature": signal_t},
        "sampled": sampled,  # one entry per temperature, in the order given: its Pass@K curve and signal
        "es": es,
        "examples": [{"prompt": prompts[i] if isinstance(prompts[i], str) else prompts[i][-1]["content"],
                      "answer": problems[i].answer, "completion": comps[i][0], "reward": rewards[i][0]}
                     for i in range(min(3, len(problems)))],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out["verdict"] = verdict(out["grpo"]["share_with_signal"], es["share_with_signal"] if es else None)
    return out


def _passes(gen, task: Task, problems, samples: int, group: int, temperatures: Sequence[float], signal_t: float,
            max_new: int, seed: int, log: Progress, progress_factory):
    """The sampled pass (`samples` per problem at each of `temperatures`, one progress bar over all) and the
    greedy pass through `gen`. Returns (one summary per temperature: its Pass@K/Maj@K at K in {1, G,
    samples} and curve, mean reward, format rate, GRPO groups with unequal rewards, and `rewards` (problems,
    samples); the signal temperature's completions (problems, samples); the greedy summary; the prompts)."""
    prompts = problem_prompts(problems, gen.chat)
    total = len(problems) * samples * len(temperatures)
    prog = progress_factory("probe: sampled", total) if progress_factory else None
    done = [0]

    def tick(k):
        done[0] += k
        if prog:
            prog(done[0], total)

    sampled, signal_comps = [], None
    stop = task.stop_strings(gen.chat)  # raw few-shot prompts: cut before the next example
    for t in temperatures:
        log(f"sampling {len(problems)} x {samples} at T={t:g}")
        comps = gen.generate(prompts, SamplingParams(n=samples, temperature=t, max_new_tokens=max_new, seed=seed,
                                                        stop=stop), progress=tick)
        summary = summarize(task, problems, comps, sorted({1, group, samples}), seed=seed)
        rewards = [[task.score_problem(c, p) for c in cs] for p, cs in zip(problems, comps)]
        groups = [r[i:i + group] for r in rewards for i in range(0, samples, group)]  # G consecutive samples
        sampled.append({"temperature": t, "pass_at_k": summary["pass_at_k"], "pass_at_k_se": summary["pass_at_k_se"],
                        "maj_at_k": summary["maj_at_k"], "curve": summary["curve"],
                        "mean_reward": summary["mean_reward"], "format_rate": summary["format_rate"],
                        "grpo_groups": len(groups),
                        "grpo_share_with_signal": sum(_distinct(g) for g in groups) / len(groups),
                        "rewards": rewards})
        if t == signal_t:
            signal_comps = comps  # the other temperatures' strings are dropped here
    log("greedy decoding")
    greedy_comps = gen.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new, stop=stop))
    greedy = summarize(task, problems, greedy_comps, [1], seed=seed)
    return sampled, greedy, signal_comps, prompts
