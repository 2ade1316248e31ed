"""The estimate: JS, verifier JS, coverage and centre token entropy of one population over prompts.

Two passes over the members (one perturb / restore each): sample M responses per prompt from each, then
score every distinct (prompt, response) pair under each (`deltalens.analysis.diversity.estimators` gives
the formulas and says which JS estimator is reported). Then the centre samples `centre_samples` (default
N·M) responses per prompt for its success rate and token entropy: the mean over every response token
(token-weighted, EOS position included) of the entropy of the centre's next-token distribution along its own
samples, at the sampling temperature (`token_entropy`, the policy sampled) and at T = 1 (`token_entropy_t1`).

Coverage: population Pass@N with one sample per member, 1 − Π_i (1 − p_i) (the product of independent
unbiased estimates of 1 − p_i, so unbiased), against the centre's Pass@N with N samples, estimated from
`centre_samples` = N·M samples of the centre with the unbiased pass@k estimator (the plug-in 1 − (1 − p̂)^N
is biased low by about as much as the gaps it is compared with).

Cost (N members, M samples per member and prompt, P prompts, L tokens per prompt + response):
sampling N·M·P responses from the members, + N·M·P from the centre; scoring: every member scores every
distinct (prompt, response) pair, N forward passes over up to N·M·P sequences, O(N²·M·P·L) token-forwards,
the dominant term (quadratic in N). Duplicate responses of a prompt are scored once (peaked models repeat
themselves, which saves a lot). `cost` in the output counts sampled / scored sequences.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from deltalens.analysis.diversity.estimators import (
    ESTIMATOR,
    coverage,
    js_from_logprobs,
    js_success,
    js_success_null,
)
from deltalens.analysis.diversity.populations import Population
from deltalens.analysis.diversity.sampling import (
    _decode,
    _seed,
    problem_ids,
    sample_responses,
    sequence_logprobs,
)
from deltalens.errors import DeltalensError
from deltalens.evaluation.passk import pass_at_k
from deltalens.tasks import CORRECT

Progress = Callable[[int, int, str], None]  # progress(done, total, stage)


def population_divergence(population: Population, task, problems, *, samples: int = 4, temperature: float = 0.6,
                          max_new_tokens: int | None = None, seed: int = 0, centre_samples: int | None = None,
                          progress: Progress | None = None, chat_template="auto") -> dict:
    """JS, JS_succ, coverage and centre token entropy of `population` on `problems`.

    js_mean / js_se (per prompt: js / js_se) are the reported estimator, named in `estimator`;
    js_direct_* the direct estimate beside it; js_mi_* the posterior estimate under its older name.

    Two passes over the members (one perturb / restore each): sample M responses per prompt from each,
    then score all distinct (prompt, response) pairs under each. Then the centre (if any) samples
    centre_samples (default N·M) responses per prompt for its success rate and token entropy.
    """
    tok, n, n_p = population.tokenizer, population.size, len(problems)
    if samples < 1 or n_p < 1:
        raise DeltalensError(f"need samples >= 1 and at least one prompt (got {samples}, {n_p})")
    mnt = max_new_tokens or task.max_new_tokens
    prompt_ids = problem_ids(tok, problems, chat_template)
    do_centre = population.centre is not None and centre_samples != 0
    centre_samples = centre_samples or n * samples
    total, done = 2 * n + int(do_centre), 0
    timing = {"sample_s": 0.0, "score_s": 0.0, "centre_s": 0.0}

    def tick(stage):
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, stage)

    if progress is not None:
        progress(0, total, "sample members")
    # 1. sampling pass: responses[i][p][m], success[i][p][m]
    responses, success = [], []
    for i in range(n):
        t0 = time.perf_counter()
        with population.member(i) as model:
            r = sample_responses(model, tok, prompt_ids, samples, temperature=temperature, max_new_tokens=mnt,
                                 seed=_seed(seed, "member", i))
        responses.append(r)
        success.append([[task.score_problem(_decode(tok, y), prob) == CORRECT for y in r[p]]
                        for p, prob in enumerate(problems)])
        timing["sample_s"] += time.perf_counter() - t0
        tick("sample members")

    # 2. distinct (prompt, response) pairs; index[i, p, m] -> row of the log-prob table
    rows: dict[tuple[int, tuple[int, ...]], int] = {}
    index = torch.empty((n, n_p, samples), dtype=torch.long)  # (N, P, M)
    for i in range(n):
        for p in range(n_p):
            for m in range(samples):
                index[i, p, m] = rows.setdefault((p, responses[i][p][m]), len(rows))
    items = list(rows)

    # 3. scoring pass: table[j, u] = log π_j(items[u])
    table = torch.empty((n, len(items)), dtype=torch.float64)  # (N, U)
    for j in range(n):
        t0 = time.perf_counter()
        with population.member(j) as model:
            table[j] = sequence_logprobs(model, prompt_ids, items, temperature)["logp"]
        timing["score_s"] += time.perf_counter() - t0
        tick("score under members")

    # 4. the centre: success rate and token entropy along its own samples
    p_centre: list[float | None] = [None] * n_p
    ent_sum = ent1_sum = 0.0
    ent_tokens = 0
    if do_centre:
        t0 = time.perf_counter()
        c_resp = sample_responses(population.centre, tok, prompt_ids, centre_samples, temperature=temperature,
                                  max_new_tokens=mnt, seed=_seed(seed, "centre"))
        p_centre = [sum(task.score_problem(_decode(tok, y), prob) == CORRECT for y in c_resp[p]) / centre_samples
                    for p, prob in enumerate(problems)]
        c_items = [(p, y) for p in range(n_p) for y in c_resp[p]]
        sc = sequence_logprobs(population.centre, prompt_ids, c_items, temperature, entropy=True)
        ent_sum, ent1_sum = float(sc["entropy"].sum()), float(sc["entropy_t1"].sum())
        ent_tokens = int(sc["tokens"].sum())
        timing["centre_s"] += time.perf_counter() - t0
        tick("centre")

    # 5. per prompt
    reported = {"posterior": "js_mi", "direct": "js"}[ESTIMATOR]  # the key of js_from_logprobs reported
    per_prompt, se_kinds = [], set()
    for p, prob in enumerate(problems):
        logp = table[:, index[:, p, :]]  # (N_j, N_i, M): response m of member i under member j
        js = js_from_logprobs(logp)
        p_members = [sum(success[i][p]) / samples for i in range(n)]
        cov = coverage(p_members, p_centre[p])
        if p_centre[p] is not None and centre_samples >= n:  # unbiased Pass@N from the centre's samples
            cov["centre"] = pass_at_k(centre_samples, round(p_centre[p] * centre_samples), n)
        js_succ, js_null = js_success(p_members), js_success_null([sum(success[i][p]) for i in range(n)], samples)
        se_kinds.add(js["se_kind"])
        per_prompt.append({
            "prompt": prob.prompt, "answer": prob.answer,
            # js / js_se: the reported ESTIMATOR (estimators.py); js_direct: the other, a cross-check;
            # js_mi: the posterior estimate under its older name
            "js": js[reported], "js_se": js[reported + "_se"], "js_direct": js["js"], "js_direct_se": js["js_se"],
            "js_mi": js["js_mi"], "js_mi_se": js["js_mi_se"],
            "js_succ": js_succ, "js_succ_null": js_null, "js_succ_corrected": js_succ - js_null,
            "p_members": p_members, "p_centre": p_centre[p],
            "coverage_population": cov["population"], "coverage_bound_rhs": cov["bound_rhs"],
            "coverage_centre": cov["centre"], "distinct_responses": len({responses[i][p][m] for i in range(n)
                                                                          for m in range(samples)}),
        })

    def mean(key):
        vals = [r[key] for r in per_prompt]
        return None if any(v is None for v in vals) else sum(vals) / len(vals)

    def se_of_mean(key):
        return math.sqrt(sum(r[key] ** 2 for r in per_prompt)) / n_p

    js_vals = [r["js"] for r in per_prompt]
    js_mean = sum(js_vals) / n_p
    cov_pop, rhs = mean("coverage_population"), mean("coverage_bound_rhs")
    return {
        "estimator": ESTIMATOR, "js_mean": js_mean, "js_se": se_of_mean("js_se"),
        "js_se_kind": f"Monte Carlo over samples, {'/'.join(sorted(se_kinds))} by member; prompts fixed",
        "js_se_prompts": (math.sqrt(sum((v - js_mean) ** 2 for v in js_vals) / (n_p - 1) / n_p)
                          if n_p > 1 else None),
        "js_direct_mean": mean("js_direct"), "js_direct_se": se_of_mean("js_direct_se"),
        "js_mi_mean": mean("js_mi"), "js_mi_se": se_of_mean("js_mi_se"),
        "js_max": math.log(n),
        "js_succ_mean": mean("js_succ"), "js_succ_null_mean": mean("js_succ_null"),
        "js_succ_corrected_mean": mean("js_succ_corrected"),
        "p_members_mean": sum(sum(r["p_members"]) / n for r in per_prompt) / n_p,
        "p_centre_mean": mean("p_centre"),
        "coverage_population": cov_pop, "coverage_centre": mean("coverage_centre"),
        "coverage_bound": {"lhs": cov_pop, "rhs": rhs, "holds": all(r["coverage_population"] >=
                                                                     r["coverage_bound_rhs"] - 1e-12
                                                                     for r in per_prompt)},
        "token_entropy": ent_sum / ent_tokens if ent_tokens else None,
        "token_entropy_t1": ent1_sum / ent_tokens if ent_tokens else None,
        "centre_samples": centre_samples if do_centre else 0,
        "per_prompt": per_prompt,
        "cost": {"sampled": n * n_p * samples + (n_p * centre_samples if do_centre else 0),
                 "scored": n * len(items), "distinct_pairs": len(items), "pairs": n * n_p * samples},
        "timing": {k: round(v, 3) for k, v in timing.items()},
    }
