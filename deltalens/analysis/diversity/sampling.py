"""Sampling and teacher-forced scoring for the diversity analysis, on token ids (never re-tokenised text).

Temperature: responses are sampled from softmax(logits / T) (top-k/top-p off) and scored with the same
distribution, EOS included; responses are cut after the first EOS or at max_new_tokens (a response
without EOS is the event "these max_new_tokens tokens first", whose probability is the same product of
conditionals), so sampling and scoring describe one distribution. T = 0 (greedy) has no JS: refused.

Departure: responses come back as token ids (`HFBackend.generate_ids`), because scoring needs them:
decoding and re-tokenising a response is not the identity for BPE tokenizers. Prompts are tokenised as
HFBackend does, chat template setting included. Both passes run in the model's own dtype (fp32 for our
masters; no --compute-dtype: the JS estimate compares log-probabilities of members σ apart, and a bf16
forward's rounding would read as divergence). `sequence_logprobs` prefills each prompt once per batch and
runs only the responses over its KV cache (prompt positions never reach the LM head); until 2026-12-07 it
ran every (prompt + response) sequence whole and took the softmax at every position, and sampling went
through transformers' `generate`. Measured: benchmarks/README.md ("bench_diversity_speed.py").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from deltalens.errors import DeltalensError
from deltalens.generation.batching import left_pad
from deltalens.generation.decode import last_logits_only, mask_positions
from deltalens.generation.hf import HFBackend
from deltalens.generation.kv_cache import cache_name, new_cache
from deltalens.generation.params import SamplingParams
from deltalens.generation.prompts import encode_prompts as generation_encode
from deltalens.generation.prompts import problem_prompts, uses_chat

# Which sampler drew the responses, for cache keys: 1 was transformers' generate (until 2026-12-07), 2 is
# HFBackend's decoding loop. Both sample softmax(logits / T); a seed gives different responses under each.
SAMPLER_VERSION = 2


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


@torch.no_grad()
def sample_responses(model, tok, prompt_ids: list[list[int]], samples: int, *, temperature: float,
                     max_new_tokens: int, seed: int, batch_tokens: int | None = None, max_batch: int = 1024,
                     progress=None):
    """out[p][m]: token ids (tuple) of sample m for prompt p, from softmax(logits / T), EOS included.

    `generation.HFBackend.generate_ids` in the model's own dtype (fp32 for a master loaded in fp32): each
    prompt prefilled once for its samples, our decoding loop (`generation.decode`), batch b sampled after
    torch.manual_seed(seed + b). A response ends at its first EOS (kept) or after max_new_tokens tokens.
    progress(done): called with the number of sequences sampled so far after each batch (of
    len(prompt_ids) x samples). The tokenizer needs a pad token (`io.models.load_model` sets EOS where a
    model has none); the model's forward `logits_to_keep` where samples > 1 (`hf.prefill_prompts`).
    """
    if temperature <= 0:
        raise DeltalensError(f"diversity needs sampling (temperature > 0, got {temperature}); "
                             "greedy decoding has no distribution to compare")
    backend = HFBackend(model, tok, batch_tokens=batch_tokens, max_batch=max_batch, compute_dtype="fp32")
    params = SamplingParams(n=samples, temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed)
    done = [0]

    def counted(k):
        done[0] += k
        progress(done[0])

    ids = backend.generate_ids(prompt_ids, params, None if progress is None else counted)
    return [[tuple(row) for row in rows] for rows in ids]


def _vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def _batches(plen: list[int], rlen: list[int], prompt: list[int], order: list[int], vocab: int, token_budget: int,
             logit_budget: int, prompt_logits: bool):
    """Consecutive runs of `order` (items sorted by prompt, then response length) within the budgets:
    rows x (longest prompt + longest response) tokens, rows x longest response x vocab logits, plus
    distinct prompts x longest prompt x vocab where the prefill returns every position's logits
    (`prompt_logits`: a model without `logits_to_keep`)."""
    pos, n = 0, len(order)
    while pos < n:
        k = order[pos]
        batch, wp, wr, g = [k], plen[k], rlen[k], 1
        while pos + len(batch) < n:
            k = order[pos + len(batch)]
            p, r = max(wp, plen[k]), max(wr, rlen[k])
            g2 = g + (prompt[k] != prompt[batch[-1]])
            rows = len(batch) + 1
            logits = rows * r + (g2 * p if prompt_logits else 0)
            if rows * (p + r) > token_budget or logits * vocab > logit_budget:
                break
            batch.append(k)
            wp, wr, g = p, r, g2
        yield batch
        pos += len(batch)


@torch.no_grad()
def sequence_logprobs(model, prompt_ids: list[list[int]], items: Sequence[tuple[int, tuple[int, ...]]],
                      temperature: float, *, entropy: bool = False, token_budget: int = 65_536,
                      logit_budget: int = 1 << 26, progress=None) -> dict:
    """Teacher-forced log π_T(y | x) = Σ_t log softmax(logits_t / T)[y_t] over the response tokens
    (EOS included) of items[k] = (prompt index, response ids).

    Items are sorted by prompt, then response length, and batched under token_budget tokens (rows x
    (prompt + response)) and logit_budget floats of logits (rows x response x vocabulary). A batch
    prefills each of its distinct prompts once (left padded, positions from the mask, logits of the last
    prompt token only: they score a response's first token), copies that KV cache to the prompt's rows,
    then runs the responses (right padded, less their last token, which predicts nothing scored) in one
    forward pass over the cache: prompt tokens pass the model once per batch instead of once per response,
    and only response positions reach the LM head and the softmax. Returns {"logp": (K,) float64}; with
    entropy also "entropy" / "entropy_t1" (K,): summed next-token entropies over the response positions at
    T and at T = 1, and "tokens" (K,) the response lengths. progress(done): items scored so far, after each
    batch.
    """
    n = len(items)
    vocab = _vocab_size(model)
    device = next(model.parameters()).device
    plen = [len(prompt_ids[p]) for p, _ in items]
    rlen = [len(y) for _, y in items]
    if 0 in plen:
        raise DeltalensError("a prompt tokenises to nothing; scoring needs at least one prompt token")
    prompt = [p for p, _ in items]
    order = sorted((k for k in range(n) if rlen[k]), key=lambda k: (prompt[k], rlen[k], k))
    keep = last_logits_only(model)
    logp = torch.zeros(n, dtype=torch.float64)
    ent = torch.zeros(n, dtype=torch.float64)
    ent1 = torch.zeros(n, dtype=torch.float64)
    done = n - len(order)  # empty responses: log-probability 0, nothing to score
    for batch in _batches(plen, rlen, prompt, order, vocab, token_budget, logit_budget, prompt_logits=not keep):
        # 1. each distinct prompt once: its KV cache, and the logits that score the first response token
        distinct = list(dict.fromkeys(prompt[k] for k in batch))
        where = {p: g for g, p in enumerate(distinct)}
        ids, att = left_pad([prompt_ids[p] for p in distinct], 0)  # (G, P), pads masked
        cache = new_cache(model.config, 0)
        first = model(input_ids=ids.to(device), attention_mask=att.to(device),
                      position_ids=mask_positions(att).to(device), use_cache=True, **{cache_name(): cache},
                      **keep).logits[:, -1].float().cpu()  # (G, V)
        group = torch.tensor([where[prompt[k]] for k in batch])  # (B,) row -> its prompt
        # 2. the responses, right padded, continuing their prompts' cache
        width = max(rlen[k] for k in batch)
        resp = torch.zeros((len(batch), width), dtype=torch.long)  # (B, R)
        ratt = torch.zeros((len(batch), width), dtype=torch.long)
        for r, k in enumerate(batch):
            resp[r, : rlen[k]] = torch.tensor(items[k][1])
            ratt[r, : rlen[k]] = 1
        # the prompt's last position predicts token 0, response position t token t + 1: the last response
        # token predicts nothing we score, so it never enters the model
        logits = first[group][:, None]  # (B, 1, V)
        if width > 1:
            cache.batch_select_indices(group.to(device))
            rpos = torch.tensor([plen[k] for k in batch])[:, None] + torch.arange(width - 1)  # (B, R - 1)
            rest = model(input_ids=resp[:, :-1].to(device),
                         attention_mask=torch.cat([att[group], ratt[:, :-1]], 1).to(device),
                         position_ids=rpos.to(device), use_cache=True, **{cache_name(): cache}).logits
            logits = torch.cat([logits, rest.float().cpu()], 1)  # (B, R, V)
            del rest
        del cache
        lp = (logits / temperature).log_softmax(-1)  # (B, R, V)
        tok_lp = lp.gather(-1, resp[..., None]).squeeze(-1)  # (B, R)
        idx = torch.tensor(batch)
        logp[idx] = (tok_lp.double() * ratt).sum(1)
        if entropy:
            h = -(lp.exp() * lp).sum(-1)  # (B, R) entropy at T
            lp1 = logits.log_softmax(-1)
            h1 = -(lp1.exp() * lp1).sum(-1)  # (B, R) entropy at T = 1
            ent[idx] = (h.double() * ratt).sum(1)
            ent1[idx] = (h1.double() * ratt).sum(1)
        done += len(batch)
        if progress is not None:
            progress(done)
    if not order and progress is not None:  # nothing to score: every response empty
        progress(done)
    out = {"logp": logp}
    if entropy:
        out.update(entropy=ent, entropy_t1=ent1, tokens=torch.tensor(rlen))
    return out


def _decode(tok, y: tuple[int, ...]) -> str:
    if y and y[-1] == tok.eos_token_id:
        y = y[:-1]
    return tok.decode(list(y), skip_special_tokens=True)
