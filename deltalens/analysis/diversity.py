"""Population diversity: Jensen-Shannon divergence across ES members, and the coverage it buys.

arXiv 2608.27351 asks why an ES population (Qiu et al., arXiv 2509.24372: N members θ_i = θ + σ ε_i)
covers more problems than its centre. For a model θ (a checkpoint, or an ES run's centre at some
iteration) and a task, this module measures, per held-out prompt x:

- Policy JS over whole responses y (prompt excluded, EOS included):
      JS(x) = (1/N) Σ_i KL(π_i(·|x) || π̄(·|x)),   π̄ = (1/N) Σ_j π_j        (nats, at most log N)
  Monte Carlo: M responses y_im ~ π_i from every member; every response is scored under every member
  by teacher forcing (log π_j(y_im|x)); log π̄ = logsumexp_j log π_j − log N; the estimate of KL_i is the
  mean over member i's samples of log π_i(y) − log π̄(y). Because log π̄ is computed exactly (not sampled),
  the estimate is unbiased. Its standard error is over samples, stratified by member:
  se = sqrt(Σ_i s_i² / M) / N with s_i² the variance of member i's M terms (M = 1: the pooled variance of
  all N terms / N, which also counts between-member spread, so it is conservative). Prompt averages
  carry se = sqrt(Σ_x se_x²) / P: the error of the Monte Carlo over these prompts, not the spread of
  JS over prompts (`js_se_prompts` gives that one).
- The same JS by a second, lower-variance estimator from the same log-prob table (`js_mi_*`): JS is the
  mutual information between member index and response, JS = E_{y~π̄}[log N − H(w(y))] with w_j(y) =
  π_j(y) / Σ_k π_k(y) the posterior over members; the pooled samples are a stratified sample of π̄. Each
  term is ≥ 0 and O(σ²), while a direct term is O(σ) with mean O(σ²): the direct estimate's relative
  error grows like 1/σ, this one's does not. On tiny at σ = 3e-4 with N·M·P = 384 samples: direct
  −0.0029 ± 0.0024, posterior form 0.0012 ± 0.0001 (the law predicts 0.0013 on that noise draw).
- Verifier-projected JS: JS_succ(x) = h(p̄) − (1/N) Σ_i h(p_i), h the binary entropy (nats), p_i member
  i's success rate on its M samples (reward == CORRECT), p̄ = mean_i p_i. The plug-in `js_succ` is biased
  upwards for small M: identical members (σ = 0) still show sampling spread in their frequencies (0.075
  nats on tiny with M = 4). `js_succ_corrected` subtracts the permutation null, the exact expectation of
  the plug-in when the N·M outcomes are shuffled across members (`js_success_null`, hypergeometric), so
  identical members give ~0 within sampling error.
- Coverage: population Pass@N with one sample per member, 1 − Π_i (1 − p_i) (the product of independent
  unbiased estimates of 1 − p_i, so unbiased), against the centre's Pass@N with N samples, estimated from
  `centre_samples` = N·M samples of the centre with the unbiased pass@k estimator (the plug-in
  1 − (1 − p̂)^N is biased low by about as much as the gaps it is compared with), and the paper's bound
  1 − Π_i (1 − p_i) ≥ 1 − (1 − p̄)^N (AM-GM; it holds for any p_i, so `holds` checks the arithmetic).
- Token entropy of the centre: mean over every response token (token-weighted, EOS position included)
  of the entropy of the centre's next-token distribution along its own samples, at the sampling
  temperature (`token_entropy`, the policy sampled) and at T = 1 (`token_entropy_t1`).
- The small-σ law (Lemma 1 of arXiv 2608.27351): E_ε[JS(x)] ≈ (σ²/2)(1 − 1/N) tr I_x(θ), I_x the Fisher
  information of the response distribution over the perturbed parameters. `fisher_trace` estimates
  tr I_x = E_{y~π}[||∇_θ log π(y|x)||²] from per-sample backward passes; `sigma_sweep` measures JS over
  σ with the same ε (scaled) and reports js_pred, plus `js_pred_draw`, the same second-order law on the
  N noise vectors actually drawn, (σ²/2)(1/N) Σ_i E_y[((ε_i − ε̄)·∇ log π(y|x))²], which removes the
  draw-to-draw spread of the noise (tens of % for N = 8). ||∇ log π(y)||² is heavy-tailed (single rare
  responses carry much of tr I), so the sweep also checks the law *paired*, on the Fisher's own samples
  (an importance-sampled JS over the law on the same responses; see `sigma_sweep`).

Temperature: responses are sampled from softmax(logits / T) (top-k/top-p off) and scored with the same
distribution, EOS included; responses are cut after the first EOS or at max_new_tokens (a response
without EOS is the event "these max_new_tokens tokens first", whose probability is the same product of
conditionals), so sampling and scoring describe one distribution. T = 0 (greedy) has no JS: refused.

Members are reconstructed exactly through `deltalens.training.es.engine.ESEngine` (perturb / restore, noise regenerated
from (run seed, iteration, member, block)); nothing here draws noise itself. An ES run's population at
`iteration=I` is the centre θ_I (checkpoint after I updates; the run's base model for I = 0) with the
noise of iteration I + 1: exactly the members the run evaluated from that centre. Without a run, fresh
members use ESConfig(seed=seed, population=N, sigma=σ) and the noise of iteration 1.

Cost (N members, M samples per member and prompt, P prompts, L tokens per prompt + response):
- sampling: N·M·P responses from the members, + N·M·P from the centre (coverage, entropy);
- scoring: every member scores every distinct (prompt, response) pair: N forward passes over up to
  N·M·P sequences, O(N²·M·P·L) token-forwards, the dominant term (quadratic in N). Sequences are scored
  in large padded batches (one perturb / restore per member per pass), and duplicate responses of a
  prompt are scored once (peaked models repeat themselves, which saves a lot).
- the σ sweep repeats sampling + scoring per σ, plus N passes scoring the P·F Fisher samples (paired
  check); the Fisher trace costs one forward + backward per distinct sample (P·F at most).
Figures: docs/tuning.md. `cost` in the output counts sampled / scored sequences.

Departures / choices
- Own sampler (`sample_responses`, HF generate, same batching and settings as `generation.HFBackend`)
  because scoring needs token ids: decoding and re-tokenising a response is not the identity for BPE
  tokenizers. Prompts are tokenised as HFBackend does, chat template setting included.
- The paper's formulas are written with plug-in success rates; we report the plug-in `js_succ` beside the
  corrected one, and the unbiased estimator for the centre's coverage.
- Additions: the posterior-entropy JS estimator, `js_se_prompts`, token entropy at T = 1, the drawn-noise
  and paired forms of the law, `cost` / `timing` / `notes` fields beside the schema's keys.
- `members` / `sigma` default to None: the run's N / σ when an ES run and iteration are given, else 32 /
  1.5e-3 (the paper's). Overriding N for a run changes its noise (seeds count over N), σ only scales it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from scipy.stats import hypergeom as sps_hypergeom

from deltalens.analysis.document import analysis_document, model_entry
from deltalens.errors import DeltalensError
from deltalens.evaluation.passk import pass_at_k
from deltalens.generation.batching import left_pad, length_batches
from deltalens.generation.prompts import encode_prompts as generation_encode
from deltalens.generation.prompts import problem_prompts, uses_chat
from deltalens.io.models import load_model
from deltalens.io.runs import RunDir
from deltalens.io.spec import default_labels
from deltalens.tasks import CORRECT, get_task
from deltalens.training.es.config import ESConfig
from deltalens.training.es.engine import ESEngine, weights_checksum
from deltalens.training.es.strategy import member_noise

Progress = Callable[[int, int, str], None]  # progress(done, total, stage)


# ----------------------------------------------------------------------------------------------
# formulas (pure; tested against hand computations)


def binary_entropy(p: float) -> float:
    """h(p) = −p log p − (1−p) log(1−p) in nats; h(0) = h(1) = 0."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -p * math.log(p) - (1 - p) * math.log1p(-p)


def _stratified_se(terms: torch.Tensor) -> tuple[float, str]:
    """SE of terms.mean() for terms (N members, M samples), member i's row iid from π_i."""
    n, m = terms.shape
    if m >= 2:
        return float(terms.var(dim=1, unbiased=True).sum().div(m).sqrt() / n), "stratified"
    if n >= 2:
        return float(terms.flatten().std(unbiased=True) / math.sqrt(n)), "pooled"
    return float("nan"), "none"


def js_from_logprobs(logp: torch.Tensor) -> dict:
    """JS estimates for one prompt from logp[j, i, m] = log π_j(y_im): response m of member i scored
    under member j. Shape (N, N, M); float64 recommended.

    Returns js (direct: mean_i mean_m log π_i − log π̄), js_se, js_mi (posterior-entropy form),
    js_mi_se, kl (N,) per member, se_kind.
    """
    n = logp.shape[0]
    if logp.shape[1] != n:
        raise ValueError(f"logp must be (N, N, M), got {tuple(logp.shape)}")
    lse = torch.logsumexp(logp, dim=0)  # (N_i, M): log Σ_j π_j(y_im)
    own = logp.diagonal(dim1=0, dim2=1).T  # (N_i, M): log π_i(y_im)
    direct = own - (lse - math.log(n))  # (N_i, M): log π_i − log π̄
    log_w = logp - lse  # (N_j, N_i, M): log posterior of member j given y_im
    mi = math.log(n) + (log_w.exp() * log_w).sum(dim=0)  # (N_i, M): log N − H(w(y_im))
    se, kind = _stratified_se(direct)
    mi_se, _ = _stratified_se(mi)
    return {"js": float(direct.mean()), "js_se": se, "js_mi": float(mi.mean()), "js_mi_se": mi_se,
            "kl": direct.mean(dim=1).tolist(), "se_kind": kind}


def js_success(p_members: Sequence[float]) -> float:
    """Verifier-projected JS: h(p̄) − mean_i h(p_i) (JS between the members' Bernoulli(p_i))."""
    pbar = sum(p_members) / len(p_members)
    return binary_entropy(pbar) - sum(binary_entropy(p) for p in p_members) / len(p_members)


def js_success_null(successes: Sequence[int], samples: int) -> float:
    """E[js_success] for *identical* members given the pooled successes: the plug-in's bias from sampling.

    Members' success rates are frequencies over `samples` draws each, so even identical members show
    spread and h(p̄) − mean h(p̂_i) > 0. Under the permutation null (the N·M outcomes shuffled across
    members, the pooled S = Σ successes kept) a member's count is hypergeometric(N·M, S, M), so the null's
    expectation is exact: h(S/NM) − E[h(X/M)], X ~ Hypergeom. Zero when samples = 1 has no spread either.
    """
    n, m = len(successes), samples
    total, s = n * m, int(sum(successes))
    xs = range(max(0, m - (total - s)), min(m, s) + 1)
    pmf = sps_hypergeom(total, s, m).pmf(list(xs))
    return binary_entropy(s / total) - float(sum(w * binary_entropy(x / m) for w, x in zip(pmf, xs)))


def coverage(p_members: Sequence[float], p_centre: float | None = None) -> dict:
    """Pass@N of the population (one sample per member) vs the paper's bound and the centre's Pass@N.

    population = 1 − Π_i (1 − p_i); bound_rhs = 1 − (1 − p̄)^N with p̄ = mean p_i (population ≥ bound_rhs
    always, by AM-GM); centre = 1 − (1 − p_centre)^N (None without p_centre).
    """
    n = len(p_members)
    pbar = sum(p_members) / n
    population = 1.0 - math.prod(1.0 - p for p in p_members)
    rhs = 1.0 - (1.0 - pbar) ** n
    return {"population": population, "bound_rhs": rhs, "holds": population >= rhs - 1e-12,
            "centre": None if p_centre is None else 1.0 - (1.0 - p_centre) ** n}


# ----------------------------------------------------------------------------------------------
# sampling and teacher-forced scoring (token ids, never re-tokenised text)


def _seed(*keys) -> int:
    """A 63-bit torch seed derived from keys (so members and the centre sample independently)."""
    h = hashlib.blake2b("/".join(map(str, ("deltalens-diversity", *keys))).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def encode_prompts(tok, prompts: Sequence, chat_template="auto") -> list[list[int]]:
    """Token ids of each prompt (raw text or chat messages), tokenised as `generation.HFBackend` does
    under the same chat-template setting (auto / on / off)."""
    ids = generation_encode(tok, prompts, uses_chat(tok, chat_template))
    if any(len(x) == 0 for x in ids):
        raise DeltalensError("a prompt tokenises to nothing; scoring needs at least one prompt token")
    return ids


def problem_ids(tok, problems, chat_template="auto") -> list[list[int]]:
    """Token ids of each problem's prompt in the form the chat-template setting picks (`encode_prompts`)."""
    return encode_prompts(tok, problem_prompts(problems, uses_chat(tok, chat_template)), chat_template)


def _cut(row: list[int], eos: int) -> tuple[int, ...]:
    """A response as sampled: up to and including the first EOS, else all max_new_tokens tokens."""
    return tuple(row[: row.index(eos) + 1]) if eos in row else tuple(row)


@torch.no_grad()
def sample_responses(model, tok, prompt_ids: list[list[int]], samples: int, *, temperature: float,
                     max_new_tokens: int, seed: int, batch_tokens: int = 262_144, max_batch: int = 4096,
                     with_logprobs: bool = False):
    """out[p][m]: token ids (tuple) of sample m for prompt p, from softmax(logits / T), EOS included.

    Batched like HFBackend (left padding, prompts grouped by length, KV cache); batch b is sampled after
    torch.manual_seed(seed + b). with_logprobs: also return lp[p][m], the log-probability generate's own
    processed scores give the sample (a cross-check of `sequence_logprobs`).
    """
    if temperature <= 0:
        raise DeltalensError(f"diversity needs sampling (temperature > 0, got {temperature}); "
                             "greedy decoding has no distribution to compare")
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out: list[list[tuple[int, ...]]] = [[()] * samples for _ in prompt_ids]
    lps: list[list[float]] = [[0.0] * samples for _ in prompt_ids]
    device = next(model.parameters()).device
    batches = length_batches([len(p) for p in prompt_ids], samples, max_new_tokens, batch_tokens, max_batch)
    for b, chunk in enumerate(batches):
        ids, att = left_pad([prompt_ids[i] for i, _ in chunk], pad)  # (B, width), left padded
        width = ids.shape[1]
        torch.manual_seed(seed + b)
        gen = model.generate(input_ids=ids.to(device), attention_mask=att.to(device),
                             max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                             top_p=1.0, top_k=0, pad_token_id=pad, eos_token_id=eos,
                             output_scores=with_logprobs, return_dict_in_generate=with_logprobs)
        seqs = (gen.sequences if with_logprobs else gen)[:, width:].cpu()  # (B, new tokens)
        if with_logprobs:
            scores = torch.stack(gen.scores, dim=1).float().cpu()  # (B, new tokens, V): logits / T
            tok_lp = scores.log_softmax(-1).gather(-1, seqs[..., None]).squeeze(-1)  # (B, new tokens)
        for r, (i, m) in enumerate(chunk):
            out[i][m] = _cut(seqs[r].tolist(), eos)
            if with_logprobs:
                lps[i][m] = float(tok_lp[r, : len(out[i][m])].double().sum())
    return (out, lps) if with_logprobs else out


def _vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


@torch.no_grad()
def sequence_logprobs(model, prompt_ids: list[list[int]], items: Sequence[tuple[int, tuple[int, ...]]],
                      temperature: float, *, entropy: bool = False, token_budget: int = 65_536,
                      logit_budget: int = 1 << 26) -> dict:
    """Teacher-forced log π_T(y | x) = Σ_t log softmax(logits_t / T)[y_t] over the response tokens
    (EOS included) of items[k] = (prompt index, response ids).

    Sequences (prompt + response, right padded) are sorted by length and batched under token_budget
    tokens and logit_budget floats of logits. Returns {"logp": (K,) float64}; with entropy also
    "entropy" / "entropy_t1" (K,): summed next-token entropies over the response positions at T and
    at T = 1, and "tokens" (K,) the response lengths.
    """
    n = len(items)
    vocab = _vocab_size(model)
    device = next(model.parameters()).device
    lengths = [len(prompt_ids[p]) + len(y) for p, y in items]
    order = sorted(range(n), key=lambda k: lengths[k])
    logp = torch.zeros(n, dtype=torch.float64)
    ent = torch.zeros(n, dtype=torch.float64)
    ent1 = torch.zeros(n, dtype=torch.float64)
    pos = 0
    while pos < n:
        batch = [order[pos]]  # ascending lengths: the last one added is the longest
        while pos + len(batch) < n:
            width = lengths[order[pos + len(batch)]]
            if (len(batch) + 1) * width > token_budget or (len(batch) + 1) * width * vocab > logit_budget:
                break
            batch.append(order[pos + len(batch)])
        width = lengths[batch[-1]]
        ids = torch.zeros((len(batch), width), dtype=torch.long)  # (B, W), right padded
        att = torch.zeros((len(batch), width), dtype=torch.long)
        resp = torch.zeros((len(batch), width - 1), dtype=torch.bool)  # position t predicts token t+1
        for r, k in enumerate(batch):
            p, y = items[k]
            a = len(prompt_ids[p])
            ids[r, : a + len(y)] = torch.tensor(list(prompt_ids[p]) + list(y))
            att[r, : a + len(y)] = 1
            resp[r, a - 1: a - 1 + len(y)] = True
        logits = model(input_ids=ids.to(device), attention_mask=att.to(device)).logits[:, :-1].float().cpu()
        lp = (logits / temperature).log_softmax(-1)  # (B, W-1, V)
        tok_lp = lp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, W-1)
        idx = torch.tensor(batch)
        logp[idx] = (tok_lp.double() * resp).sum(1)
        if entropy:
            h = -(lp.exp() * lp).sum(-1)  # (B, W-1) entropy at T
            lp1 = logits.log_softmax(-1)
            h1 = -(lp1.exp() * lp1).sum(-1)  # (B, W-1) entropy at T = 1
            ent[idx] = (h.double() * resp).sum(1)
            ent1[idx] = (h1.double() * resp).sum(1)
        pos += len(batch)
    out = {"logp": logp}
    if entropy:
        out.update(entropy=ent, entropy_t1=ent1, tokens=torch.tensor([len(y) for _, y in items]))
    return out


# ----------------------------------------------------------------------------------------------
# populations: N policies over one tokenizer


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


# ----------------------------------------------------------------------------------------------
# the estimate


def _decode(tok, y: tuple[int, ...]) -> str:
    if y and y[-1] == tok.eos_token_id:
        y = y[:-1]
    return tok.decode(list(y), skip_special_tokens=True)


def population_divergence(population: Population, task, problems, *, samples: int = 4, temperature: float = 0.6,
                          max_new_tokens: int | None = None, seed: int = 0, centre_samples: int | None = None,
                          progress: Progress | None = None, chat_template="auto") -> dict:
    """JS (two estimators), JS_succ, coverage and centre token entropy of `population` on `problems`.

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
            "js": js["js"], "js_se": js["js_se"], "js_mi": js["js_mi"], "js_mi_se": js["js_mi_se"],
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
        "js_mean": js_mean, "js_se": se_of_mean("js_se"),
        "js_se_kind": f"Monte Carlo over samples, {'/'.join(sorted(se_kinds))} by member; prompts fixed",
        "js_se_prompts": (math.sqrt(sum((v - js_mean) ** 2 for v in js_vals) / (n_p - 1) / n_p)
                          if n_p > 1 else None),
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


# ----------------------------------------------------------------------------------------------
# the small-σ law: JS ≈ (σ²/2)(1 − 1/N) tr I_x(θ)


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
    when N × D exceeds 2·10⁸ floats). Measured: js_mean / js_mi_mean from `population_divergence`
    (members' own samples, independent of the Fisher samples), ratio = js_mean / js_pred.

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
            "sigma": s, "js_mean": r["js_mean"], "js_se": r["js_se"], "js_mi_mean": r["js_mi_mean"],
            "js_mi_se": r["js_mi_se"], "js_pred": pred, "js_pred_se": k * (1 - 1 / n) * tr_se,
            "js_pred_draw": k * float(quad.mean()) if quad is not None else None,
            "ratio": r["js_mean"] / pred if pred > 0 else None,
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


# ----------------------------------------------------------------------------------------------
# model / run resolution and the schema section


def _run_checkpoints(run_dir: Path, cfg: dict) -> dict[int, str]:
    """iteration -> model spec of every saved centre of an ES run (0: the run's base model)."""
    found = {it: str(d) for it, d in RunDir(run_dir).checkpoints().items()}
    found[0] = str(cfg["model"])
    return found


def load_population(model_spec: str, task, *, members: int | None = None, sigma: float | None = None,
                    iteration: int | None = None, seed: int = 0, dtype: str | None = None,
                    chat_template: str = "auto", config: str | None = None) -> tuple[ESPopulation, dict]:
    """The population a `diversity_section` call describes, and a dict of what it is (for the record).

    An ES run with `iteration`: the centre checkpoint after `iteration` updates (or the nearest saved
    one, noted), its dtype and parameter filter, the run's seed / N / σ unless given, the noise of the
    next iteration. Otherwise: load_model(model_spec) and fresh noise (seed, iteration 1); `config`
    names the architecture of a bare weight file (as for `deltalens eval --config`).
    """
    notes: list[str] = []
    if iteration is not None:
        if not RunDir.is_run(model_spec):
            raise DeltalensError(f"--iteration needs an ES run directory; {model_spec} is not one "
                                 "(drop --iteration to use fresh seeds with --members/--sigma)")
        raw = RunDir(model_spec).config()
        if raw.get("method", "es") != "es":
            raise DeltalensError(f"{model_spec} is a {raw.get('method')} run; --iteration needs an ES run")
        cfg = ESConfig.from_dict(raw)
        saved = _run_checkpoints(Path(model_spec), raw)
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
        rows = {r.get("iteration"): r for r in RunDir(model_spec).metrics()}
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
        model, tok = load_model(model_spec, config=config, dtype=dtype or "fp32")
        cfg = ESConfig(seed=seed, population=members or 32, sigma=sigma if sigma else 1.5e-3,
                       dtype=dtype or "fp32", chat_template=chat_template)
        info = {"model": model_spec, "centre": model_spec, "iteration": None, "centre_iteration": None,
                "noise": {"source": "fresh", "seed": seed, "iteration": 1, "antithetic": False, "params": ["*"]},
                "dtype": dtype or "fp32"}
        noise_iteration = 1
    pop = ESPopulation(model, tok, task, cfg, noise_iteration, sigma=sigma if sigma is not None else cfg.sigma)
    info["notes"] = notes
    return pop, info


def diversity_section(model_spec: str, task, *, members: int | None = None, sigma: float | None = None,
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
    section = {"sigma": pop.sigma, "members": pop.size, "prompts": len(problems), "samples": samples,
               "temperature": temperature, "max_new_tokens": max_new_tokens or t.max_new_tokens, "task": t.spec,
               "seed": seed, **info, **res}
    if n_sweep:
        section["sigma_sweep"] = sigma_sweep(
            pop.model, pop.tokenizer, t, list(sweep), config=pop.config, iteration=pop.iteration,
            prompts=prompts, samples=samples, temperature=temperature, seed=seed, fisher_samples=fisher_samples,
            max_new_tokens=max_new_tokens, progress=prog, chat_template=chat_template)
    section["timing"] = {**res["timing"], "total_s": round(time.perf_counter() - t0, 3)}
    return section


def diversity_analysis(model_spec: str, task, *, label: str | None = None, **options) -> dict:
    """An analysis.json document (schema_version, base, models, diversity) for one model or ES run.

    base is the run's base model for a run directory, else the model itself; options go to
    `diversity_section`.
    """
    label = label or default_labels([model_spec])[0]
    base = model_spec
    if RunDir.is_run(model_spec):
        base = str(json.loads((Path(model_spec) / "config.json").read_text()).get("model", model_spec))
    section = diversity_section(model_spec, task, **options)
    return analysis_document(base, [model_entry(label, model_spec)], diversity={label: section})
