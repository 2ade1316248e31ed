"""The small-σ law (Lemma 1 of arXiv 2608.27351): E_ε[JS(x)] ≈ (σ²/2)(1 − 1/N) tr I_x(θ), measured over σ.

I_x is the Fisher information of the response distribution over the perturbed parameters. `fisher_trace`
estimates tr I_x = E_{y~π}[||∇_θ log π(y|x)||²] from per-sample backward passes; `sigma_sweep` measures JS
over σ with the same ε (scaled) and reports js_pred, plus `js_pred_draw`, the same second-order law on the
N noise vectors actually drawn, (σ²/2)(1/N) Σ_i E_y[((ε_i − ε̄)·∇ log π(y|x))²], which removes the
draw-to-draw spread of the noise (tens of % for N = 8). ||∇ log π(y)||² is heavy-tailed (single rare
responses carry much of tr I), so the sweep also checks the law *paired*, on the Fisher's own samples (an
importance-sampled JS over the law on the same responses; see `sigma_sweep`). The measured JS of each row
is the reported estimator (`deltalens.analysis.diversity.estimators.ESTIMATOR`).

Cost: the sweep repeats sampling + scoring per σ, plus N passes scoring the P·F Fisher samples (paired
check); the Fisher trace costs one forward + backward per distinct sample (P·F at most). Figures:
docs/tuning.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from deltalens.analysis.diversity.divergence import Progress, population_divergence
from deltalens.analysis.diversity.populations import ESPopulation
from deltalens.analysis.diversity.sampling import _seed, problem_ids, sample_responses, sequence_logprobs
from deltalens.errors import DeltalensError
from deltalens.training.es.config import ESConfig


def fisher_trace(model, tok, task, problems, params: Sequence[torch.Tensor], *, samples: int = 16,
                 temperature: float = 0.6, max_new_tokens: int | None = None, seed: int = 0,
                 directions: torch.Tensor | None = None, chat_template="auto") -> list[dict]:
    """tr I_x over `params` per prompt: mean over y ~ π_T(·|x) of ||∇ log π_T(y|x)||² (one backward per
    distinct sample), with its standard error over samples.

    Per prompt: trace, trace_se, and the samples themselves: responses (F token-id tuples) and sq (F,)
    their squared score norms. directions (K, D), flattened over `params` in order: also quad (F, K) =
    (d_k·∇ log π(y))² per sample, the Fisher quadratic form of each direction (the law on drawn noise).
    """
    mnt = max_new_tokens or task.max_new_tokens
    prompt_ids = problem_ids(tok, problems, chat_template)
    resp = sample_responses(model, tok, prompt_ids, samples, temperature=temperature, max_new_tokens=mnt,
                            seed=_seed(seed, "fisher"))
    params = list(params)
    saved = [p.requires_grad for p in params]
    device = next(model.parameters()).device
    cache: dict[tuple[int, tuple[int, ...]], tuple[float, torch.Tensor | None]] = {}
    out = []
    try:
        for p in params:
            p.requires_grad_(True)
        for x in range(len(problems)):
            for y in resp[x]:
                if (x, y) in cache:
                    continue
                a = len(prompt_ids[x])
                ids = torch.tensor([list(prompt_ids[x]) + list(y)], device=device)  # (1, a + R)
                with torch.enable_grad():
                    logits = model(input_ids=ids).logits[0, a - 1: -1].float()  # (R, V)
                    lp = (logits / temperature).log_softmax(-1).gather(-1, ids[0, a:, None]).sum()
                    grads = torch.autograd.grad(lp, params)
                g = torch.cat([gr.detach().float().flatten().cpu() for gr in grads])  # (D,)
                q = (directions @ g).double().square() if directions is not None else None  # (K,)
                cache[(x, y)] = (float(g.double().square().sum()), q)
            sq = torch.tensor([cache[(x, y)][0] for y in resp[x]], dtype=torch.float64)  # (F,)
            row = {"trace": float(sq.mean()),
                   "trace_se": float(sq.std(unbiased=True) / math.sqrt(len(sq))) if len(sq) > 1 else None,
                   "responses": resp[x], "sq": sq}
            if directions is not None:
                row["quad"] = torch.stack([cache[(x, y)][1] for y in resp[x]])  # (F, K)
            out.append(row)
    finally:
        for p, s in zip(params, saved):
            p.requires_grad_(s)
    return out


def _ratio(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Σa / Σb and its delta-method standard error, for paired per-sample terms a, b (K,)."""
    r = float(a.sum() / b.sum())
    return r, float((a - r * b).square().sum().sqrt() / b.sum().abs())


def sigma_sweep(model, tokenizer, task, sigmas: Sequence[float], *, config=None, iteration: int = 1,
                members: int | None = None, prompts: int = 8, samples: int = 4, temperature: float = 0.6,
                seed: int = 0, fisher_samples: int = 32, max_new_tokens: int | None = None,
                draw_prediction: bool = True, progress: Progress | None = None, chat_template="auto") -> list[dict]:
    """Measured JS against the small-σ law over `sigmas`, one row per σ (schema `sigma_sweep`).

    The noise is `config`'s (an ESConfig; default ESConfig(seed, population=members or 8)) at
    `iteration`, the same ε for every σ. tr I_x is estimated once at the centre (`fisher_trace`, over
    the perturbed parameters, F = fisher_samples per prompt); js_pred = (σ²/2)(1 − 1/N) mean_x tr I_x,
    js_pred_draw = (σ²/2) mean_x (1/N) Σ_i E_y[((ε_i − ε̄)·∇ log π)²], the law on the drawn ε (skipped
    when N × D exceeds 2·10⁸ floats). Measured: js_mean (the reported estimator) / js_direct_mean /
    js_mi_mean from `population_divergence` (members' own samples, independent of the Fisher samples),
    ratio = js_mean / js_pred (ratio_direct, ratio_mi likewise).

    Paired check (`ratio_paired`, `ratio_paired_draw`): ||∇ log π(y)||² is heavy-tailed (rare responses
    carry much of tr I), so two independent estimates disagree by more than their standard errors
    suggest. The same F centre samples also give an importance-sampled JS, js_is = mean_y (1/N) Σ_i
    (π_i/π)(y)·log(π_i/π̄)(y) (exact weights: every sample scored under every member and the centre),
    and its ratio to the law on those very samples (delta-method se) tests Lemma 1 sample by sample.
    """
    if not sigmas:
        raise DeltalensError("sigma sweep needs at least one sigma")
    if config is None:
        config = ESConfig(seed=seed, population=members or 8)
    elif members is not None and members != config.population:
        config = dataclasses.replace(config, population=members, population_batch=0)
    problems = task.test(prompts)
    pop0 = ESPopulation(model, tokenizer, task, config, iteration, sigma=0.0)
    n = pop0.size
    steps, done = 1 + len(sigmas) * 3 * n, 0

    def tick(stage, k=1):
        nonlocal done
        done += k
        if progress is not None:
            progress(done, steps, stage)

    directions = None
    if draw_prediction and n * pop0.engine.n_trained <= 2e8:
        eps = torch.stack([pop0.noise(i) for i in range(n)])  # (N, D)
        directions = eps - eps.mean(0, keepdim=True)  # ε_i − ε̄
    fisher = fisher_trace(model, tokenizer, task, problems, pop0.params(), samples=fisher_samples,
                          temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                          directions=directions, chat_template=chat_template)
    pop0.close()
    tr = sum(f["trace"] for f in fisher) / len(fisher)
    tr_se = math.sqrt(sum((f["trace_se"] or 0.0) ** 2 for f in fisher)) / len(fisher)
    sq = torch.cat([f["sq"] for f in fisher])  # (P·F,) every Fisher sample, prompts in order
    quad = torch.cat([f["quad"] for f in fisher]).mean(1) if directions is not None else None  # (P·F,) mean_i
    # the Fisher samples as distinct (prompt, response) pairs, scored once under the centre
    prompt_ids = problem_ids(tokenizer, problems, chat_template)
    rows_of: dict[tuple[int, tuple[int, ...]], int] = {}
    sample_row = torch.tensor([rows_of.setdefault((x, y), len(rows_of)) for x, f in enumerate(fisher)
                               for y in f["responses"]])  # (P·F,) -> distinct pair
    items = list(rows_of)
    lp_centre = sequence_logprobs(model, prompt_ids, items, temperature)["logp"]  # (U,)
    tick("Fisher trace")

    rows = []
    for s in sigmas:
        pop = ESPopulation(model, tokenizer, task, config, iteration, sigma=s)

        def sub(d, _total, stage, base=done, s=s):
            if progress is not None:
                progress(base + d, steps, f"σ={s:g}: {stage}")

        try:
            r = population_divergence(pop, task, problems, samples=samples, temperature=temperature,
                                      max_new_tokens=max_new_tokens, seed=seed, centre_samples=0, progress=sub,
                                      chat_template=chat_template)
            done += 2 * n
            lp = torch.empty((n, len(items)), dtype=torch.float64)  # (N, U): Fisher samples under members
            for j in range(n):
                with pop.member(j) as m:
                    lp[j] = sequence_logprobs(m, prompt_ids, items, temperature)["logp"]
                tick(f"σ={s:g}: paired check")
        finally:
            pop.close()
        log_mix = torch.logsumexp(lp, 0) - math.log(n)  # (U,) log π̄
        js_terms = ((lp - lp_centre).exp() * (lp - log_mix)).mean(0)[sample_row]  # (P·F,)
        k = 0.5 * s * s
        pred_terms = k * (1 - 1 / n) * sq  # (P·F,)
        pred = k * (1 - 1 / n) * tr
        paired, paired_se = _ratio(js_terms, pred_terms)
        row = {
            "sigma": s, "estimator": r["estimator"], "js_mean": r["js_mean"], "js_se": r["js_se"],
            "js_direct_mean": r["js_direct_mean"], "js_direct_se": r["js_direct_se"], "js_mi_mean": r["js_mi_mean"],
            "js_mi_se": r["js_mi_se"], "js_pred": pred, "js_pred_se": k * (1 - 1 / n) * tr_se,
            "js_pred_draw": k * float(quad.mean()) if quad is not None else None,
            "ratio": r["js_mean"] / pred if pred > 0 else None,
            "ratio_direct": r["js_direct_mean"] / pred if pred > 0 else None,
            "ratio_mi": r["js_mi_mean"] / pred if pred > 0 else None,
            "js_is": float(js_terms.mean()), "js_is_se": float(js_terms.std(unbiased=True) / math.sqrt(len(sq))),
            "ratio_paired": paired, "ratio_paired_se": paired_se, "ratio_paired_draw": None,
            "ratio_paired_draw_se": None,
            "fisher_trace": tr, "fisher_trace_se": tr_se, "members": n, "prompts": len(problems),
            "samples": samples, "fisher_samples": fisher_samples, "timing": r["timing"],
        }
        if quad is not None:
            row["ratio_paired_draw"], row["ratio_paired_draw_se"] = _ratio(js_terms, k * quad)
        rows.append(row)
    return rows
