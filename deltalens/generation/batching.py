"""The one batching loop of every HF-generate path (evaluation, ES members, diversity sampling).

Work items are (prompt index, sample index) pairs. Prompts are sorted by token length (ties by index),
so a batch needs little padding, and a batch holds as many items as fit in `batch_tokens` tokens of
(longest prompt in the batch + max_new_tokens); callers write each result back at its (prompt, sample)
place, so the order of the batches never shows. A prompt's samples are consecutive items, so a batch
holds each of its prompts' samples side by side (`HFBackend` prefills such a prompt once for all of
them). Sequences are left padded (generation appends on the right) with an attention mask, to which
transformers appends one column per decoding step.

What the budget bounds: the KV cache of a batch holds at most batch_tokens x `kv_bytes_per_token`
bytes (2 x layers x KV heads x head size values of the compute dtype per token: 4 bytes fp32, 2 bf16),
whatever the number of problems or samples; a budget below one sequence's length still makes batches
of one sequence, so any budget works. Beside it, one layer's prefill activations
(O(prefill rows x longest prompt x (intermediate size + heads x longest prompt)), the scores where SDPA
does not fuse them) and the last position's logits (rows x vocabulary, fp32, a few copies while
sampling). `token_budget` picks the default budget from a KV byte budget (`KV_BUDGET_BYTES`, 512 MiB),
capped at `MAX_BATCH_TOKENS`: SmolLM2-135M (30 layers, 3 KV heads x 64) stores 46,080 bytes per token
in fp32, so 11,650 tokens (~47 rows of a 148-token prompt + 96 new tokens), 23,300 in bf16; tiny
(4 layers, 2 x 32) 2,048 bytes, so the cap, 262,144 tokens (its batches as before the byte budget).
Where the samples of a prompt share its cache (`shared`, `kv_cache.share_prefix`) a row holds only its own
tokens and the prompt is held once (in fp32, counted as two bf16 tokens per token), so the same budget
holds more rows: SmolLM2 in bf16 at 32 samples, 214 rows of a 148-token prompt + 96 new tokens instead
of 95.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

MAX_BATCH_TOKENS = 262_144  # the most tokens per batch whatever the KV budget allows
KV_BUDGET_BYTES = 512 * 2**20  # default KV cache budget of one batch (tokens = this / kv_bytes_per_token)


def kv_bytes_per_token(config, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of KV cache one token takes in a decoder of this (HF) config: 2 (K and V) x layers x KV
    heads x head size x the dtype's size. Sliding-window layers are counted in full (an upper bound)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def token_budget(config, dtype: torch.dtype = torch.float32, kv_bytes: int = KV_BUDGET_BYTES) -> int:
    """Tokens per batch whose KV cache fits in `kv_bytes` (at least 1, at most `MAX_BATCH_TOKENS`);
    `MAX_BATCH_TOKENS` where the config does not say its shape."""
    try:
        per_token = kv_bytes_per_token(config, dtype)
    except (AttributeError, TypeError):
        return MAX_BATCH_TOKENS
    return max(1, min(MAX_BATCH_TOKENS, kv_bytes // per_token))


def length_batches(lengths: Sequence[int], n: int, max_new_tokens: int, batch_tokens: int,
                   max_batch: int, shared: bool = False) -> Iterator[list[tuple[int, int]]]:
    """Batches of (prompt index, sample index) items: prompts by length, n samples each, consecutive.
    shared: a prompt's samples share its cache (`kv_cache.share_prefix`), so a row costs its own
    max_new_tokens + 1 tokens and 1/n of its prompt (plus one prompt for a batch that splits one), the
    prompt counted twice: it is kept in fp32, twice a bf16 token's bytes (an fp32 run over-counts it)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    items = [(i, j) for i in order for j in range(n)]
    pos = 0
    while pos < len(items):
        # batch size from the longest prompt in the batch (items are sorted by length)
        longest = lengths[items[min(pos + max_batch, len(items)) - 1][0]]
        if shared and n > 1:
            bs = (batch_tokens - 2 * longest) // (max_new_tokens + 1 + 2 * -(-longest // n))
        else:
            bs = batch_tokens // (longest + max_new_tokens)
        bs = max(1, min(max_batch, bs))
        chunk = items[pos: pos + bs]
        yield chunk
        pos += len(chunk)


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both (B, longest) long tensors, each row right-aligned."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        if len(s):
            ids[r, width - len(s):] = torch.tensor(list(s))
            att[r, width - len(s):] = 1
    return ids, att
