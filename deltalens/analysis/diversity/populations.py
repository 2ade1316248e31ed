"""Populations: N policies over one tokenizer, and the ES population a diversity section describes.

Members are reconstructed exactly through `deltalens.training.es.engine.ESEngine` (perturb / restore, noise
regenerated from (run seed, iteration, member, block)); nothing here draws noise itself. An ES run's
population at `iteration=I` is the centre θ_I (checkpoint after I updates; the run's base model for I = 0)
with the noise of iteration I + 1: exactly the members the run evaluated from that centre. Without a run,
fresh members use ESConfig(seed=seed, population=N, sigma=σ) and the noise of iteration 1.

`members` / `sigma` default to None: the run's N / σ when an ES run and iteration are given, else 32 /
1.5e-3 (the paper's). Overriding N for a run changes its noise (seeds count over N), σ only scales it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from deltalens.errors import DeltalensError
from deltalens.io.models import load_model
from deltalens.io.runs import RunDir
from deltalens.io.spec import ModelRef
from deltalens.training.es.config import ESConfig
from deltalens.training.es.engine import ESEngine, weights_checksum
from deltalens.training.es.strategy import member_noise


class Population:
    """N policies sharing a tokenizer. `with pop.member(i) as model:` gives a model that *is* member i
    for the duration of the block; `centre` is the unperturbed model (None if there is none)."""

    size: int
    tokenizer = None
    centre = None

    def member(self, i: int) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ModelPopulation(Population):
    """Explicit models as members (tests, hand-built policies); any HF causal LM works."""

    def __init__(self, models: Sequence, tokenizer, centre=None):
        if len(models) < 1:
            raise DeltalensError("a population needs at least one member")
        self.models, self.tokenizer, self.centre, self.size = list(models), tokenizer, centre, len(models)

    @contextlib.contextmanager
    def member(self, i: int) -> Iterator:
        yield self.models[i]


class ESPopulation(Population):
    """θ_i = θ + σ ε_i of `iteration`, reconstructed in place by `ESEngine.perturb` / `restore`.

    `config` gives the noise (seed, population, antithetic, params filter); `sigma` overrides its σ
    (same ε, scaled; σ = 0 gives N copies of the centre). Restore is always the exact copy-back.
    """

    def __init__(self, model, tokenizer, task, config, iteration: int, sigma: float | None = None):
        sigma = config.sigma if sigma is None else float(sigma)
        if sigma < 0 or not math.isfinite(sigma):
            raise DeltalensError(f"sigma must be >= 0 (got {sigma}); set --sigma")
        if iteration < 1:
            raise DeltalensError(f"noise iteration must be >= 1 (got {iteration})")
        cfg = dataclasses.replace(config, sigma=sigma if sigma > 0 else config.sigma, restore="copy",
                                  population_batch=0)  # members are rebuilt one at a time
        self.engine = ESEngine(model, tokenizer, task, cfg)
        self.model, self.tokenizer, self.centre = model, tokenizer, model
        self.config, self.iteration, self.sigma, self.size = cfg, iteration, sigma, cfg.population
        self.timing = {"noise_s": 0.0, "perturb_restore_s": 0.0}

    @contextlib.contextmanager
    def member(self, i: int) -> Iterator:
        if not 0 <= i < self.size:
            raise IndexError(f"member {i} of {self.size}")
        if self.sigma == 0:
            yield self.model
            return
        self.engine.perturb(self.iteration, i, self.timing)
        try:
            yield self.model
        finally:
            self.engine.restore(self.iteration, i, self.timing)

    def params(self) -> list[torch.Tensor]:
        """The perturbed tensors (tied weights once), in the engine's order."""
        return [p for _, _, p in self.engine.params]

    def noise(self, i: int) -> torch.Tensor:
        """sign·ε_k of member i over the perturbed tensors, flattened (D,) fp32, from the engine."""
        k, sign = member_noise(i, self.config.antithetic)
        return torch.cat([self.engine.noise_of(self.iteration, k, name).flatten()
                          for _, name, _ in self.engine.params]).mul_(sign)

    def close(self) -> None:
        self.engine.close()


def _run_checkpoints(run_dir: Path, cfg: dict) -> dict[int, str]:
    """iteration -> model spec of every saved centre of an ES run (0: the run's base model)."""
    found = {it: str(d) for it, d in RunDir(run_dir).checkpoints().items()}
    found[0] = str(cfg["model"])
    return found


def load_population(model_spec: str | ModelRef, task, *, members: int | None = None, sigma: float | None = None,
                    iteration: int | None = None, seed: int = 0, dtype: str | None = None,
                    chat_template: str = "auto", config: str | None = None) -> tuple[ESPopulation, dict]:
    """The population a `diversity_section` call describes, and a dict of what it is (for the record).

    An ES run with `iteration`: the centre checkpoint after `iteration` updates (or the nearest saved
    one, noted), its dtype and parameter filter, the run's seed / N / σ unless given, the noise of the
    next iteration. Otherwise: load_model(model_spec) and fresh noise (seed, iteration 1); `config`
    names the architecture of a bare weight file (as for `deltalens eval --config`). `model_spec` may be
    a resolved `ModelRef` (loaded as it is; its `run` is the run directory).
    """
    notes: list[str] = []
    ref = model_spec if isinstance(model_spec, ModelRef) else None
    if ref is not None:
        run = ref.run
        model_spec = ref.spec
    else:
        run = Path(model_spec) if RunDir.is_run(model_spec) else None
    if iteration is not None:
        if run is None:
            raise DeltalensError(f"--iteration needs an ES run directory; {model_spec} is not one "
                                 "(drop --iteration to use fresh seeds with --members/--sigma)")
        raw = RunDir(run).config()
        if raw.get("method", "es") != "es":
            raise DeltalensError(f"{model_spec} is a {raw.get('method')} run; --iteration needs an ES run")
        cfg = ESConfig.from_dict(raw)
        saved = _run_checkpoints(run, raw)
        if iteration < 0:
            raise DeltalensError(f"--iteration must be >= 0 (got {iteration})")
        centre_it = min(saved, key=lambda k: (abs(k - iteration), k))
        if centre_it != iteration:
            notes.append(f"no checkpoint after iteration {iteration}; used the nearest saved centre, "
                         f"iteration {centre_it}")
        if members is not None and members != cfg.population:
            notes.append(f"members {members} differs from the run's {cfg.population}: the noise is not the "
                         "run's (noise seeds are counted over N)")
        cfg = dataclasses.replace(cfg, population=members or cfg.population, population_batch=0, budget=None,
                                  sigma=cfg.sigma if sigma is None or sigma == 0 else sigma)
        if cfg.restore == "subtract":
            notes.append("the run restored members by subtraction (inexact), so its members carried rounding "
                         "drift that this exact reconstruction does not")
        if dtype is not None and dtype != cfg.dtype:
            notes.append(f"loaded in {dtype}, the run trained in {cfg.dtype}: members differ from the run's")
        model, tok = load_model(saved[centre_it], dtype=dtype or cfg.dtype)
        checksum = "unverified"
        rows = {r.get("iteration"): r for r in RunDir(run).metrics()}
        if (dtype or cfg.dtype) == cfg.dtype and rows.get(centre_it, {}).get("checksum"):
            if weights_checksum(model) != rows[centre_it]["checksum"]:
                raise DeltalensError(f"checkpoint {saved[centre_it]} does not match the weights checksum the run "
                                     f"logged for iteration {centre_it}; it was modified or is corrupt")
            checksum = "verified"
        info = {"model": model_spec, "centre": saved[centre_it], "iteration": iteration,
                "centre_iteration": centre_it, "noise": {"source": "run", "seed": cfg.seed,
                                                         "iteration": centre_it + 1,
                                                         "antithetic": cfg.antithetic,
                                                         "params": list(cfg.params)},
                "centre_checksum": checksum, "dtype": dtype or cfg.dtype}
        noise_iteration = centre_it + 1
    else:
        model, tok = load_model(ref if ref is not None else model_spec, config=config, dtype=dtype or "fp32")
        cfg = ESConfig(seed=seed, population=members or 32, sigma=sigma if sigma else 1.5e-3,
                       dtype=dtype or "fp32", chat_template=chat_template)
        info = {"model": model_spec, "centre": model_spec, "iteration": None, "centre_iteration": None,
                "noise": {"source": "fresh", "seed": seed, "iteration": 1, "antithetic": False, "params": ["*"]},
                "dtype": dtype or "fp32"}
        noise_iteration = 1
    pop = ESPopulation(model, tok, task, cfg, noise_iteration, sigma=sigma if sigma is not None else cfg.sigma)
    info["notes"] = notes
    return pop, info
