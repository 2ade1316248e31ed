"""Sampling and teacher-forced scoring for the diversity analysis, on token ids (never re-tokenised text).

Temperature: responses are sampled from softmax(logits / T) (top-k/top-p off) and scored with the same
distribution, EOS included; responses are cut after the first EOS or at max_new_tokens (a response
without EOS is the event "these max_new_tokens tokens first", whose probability is the same product of
conditionals), so sampling and scoring describe one distribution. T = 0 (greedy) has no JS: refused.

Departure: our own sampler (`sample_responses`, HF generate, same batching and settings as
`generation.HFBackend`) because scoring needs token ids: decoding and re-tokenising a response is not the
identity for BPE tokenizers. Prompts are tokenised as HFBackend does, chat template setting included.
`sequence_logprobs` scores in large padded batches sorted by length (and gives next-token entropies).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from deltalens.errors import DeltalensError
from deltalens.generation.batching import left_pad, length_batches
from deltalens.generation.prompts import encode_prompts as generation_encode
from deltalens.generation.prompts import problem_prompts, uses_chat


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
                     with_logprobs: bool = False, progress=None):
    """out[p][m]: token ids (tuple) of sample m for prompt p, from softmax(logits / T), EOS included.

    Batched like HFBackend (left padding, prompts grouped by length, KV cache); batch b is sampled after
    torch.manual_seed(seed + b). with_logprobs: also return lp[p][m], the log-probability generate's own
    processed scores give the sample (a cross-check of `sequence_logprobs`). progress(done): called with the
    number of sequences sampled so far after each batch (of len(prompt_ids) x samples).
    """
    if temperature <= 0:
        raise DeltalensError(f"diversity needs sampling (temperature > 0, got {temperature}); "
                             "greedy decoding has no distribution to compare")
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out: list[list[tuple[int, ...]]] = [[()] * samples for _ in prompt_ids]
    lps: list[list[float]] = [[0.0] * samples for _ in prompt_ids]
    device = next(model.parameters()).device
    batches = length_batches([len(p) for p in prompt_ids], samples, max_new_tokens, batch_tokens, max_batch)
    done = 0
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
        done += len(chunk)
        if progress is not None:
            progress(done)
    return (out, lps) if with_logprobs else out


def _vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


@torch.no_grad()
def sequence_logprobs(model, prompt_ids: list[list[int]], items: Sequence[tuple[int, tuple[int, ...]]],
                      temperature: float, *, entropy: bool = False, token_budget: int = 65_536,
                      logit_budget: int = 1 << 26, progress=None) -> dict:
    """Teacher-forced log π_T(y | x) = Σ_t log softmax(logits_t / T)[y_t] over the response tokens
    (EOS included) of items[k] = (prompt index, response ids).

    Sequences (prompt + response, right padded) are sorted by length and batched under token_budget
    tokens and logit_budget floats of logits. Returns {"logp": (K,) float64}; with entropy also
    "entropy" / "entropy_t1" (K,): summed next-token entropies over the response positions at T and
    at T = 1, and "tokens" (K,) the response lengths. progress(done): items scored so far, after each batch.
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
        if progress is not None:
            progress(pos)
    out = {"logp": logp}
    if entropy:
        out.update(entropy=ent, entropy_t1=ent1, tokens=torch.tensor([len(y) for _, y in items]))
    return out


def _decode(tok, y: tuple[int, ...]) -> str:
    if y and y[-1] == tok.eos_token_id:
        y = y[:-1]
    return tok.decode(list(y), skip_special_tokens=True)
