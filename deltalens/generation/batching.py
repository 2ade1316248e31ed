"""The one batching loop of every HF-generate path (evaluation, ES members, diversity sampling).

Work items are (prompt index, sample index) pairs. Prompts are sorted by token length (ties by index),
so a batch needs little padding, and a batch holds as many items as fit in `batch_tokens` tokens of
(longest prompt in the batch + max_new_tokens); callers write each result back at its (prompt, sample)
place, so the order of the batches never shows. Sequences are left padded (generation appends on the
right) with an attention mask, to which transformers appends one column per decoding step.

Peak memory beyond the weights (and a compute copy, `deltalens.generation.dtype`) is bounded by the
budget, whatever the number of problems: the KV cache holds at most 2 * layers * kv_dim * batch_tokens
values of the compute dtype (4 bytes fp32, 2 bf16); prefill activations are O(batch_tokens x
(intermediate size + heads x longest prompt)) for one layer at a time (the MLP, and attention scores
where SDPA does not fuse them); logits are kept for the last position only (rows x vocabulary, fp32).
E.g. SmolLM2-135M (30 layers, kv_dim 192) at the default 262,144 tokens: KV cache <= 12.1 GB in fp32,
6.0 GB in bf16; a smaller `batch_tokens` bounds it proportionally. A budget below one sequence's length
still makes batches of one sequence, so any budget works.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def length_batches(lengths: Sequence[int], n: int, max_new_tokens: int, batch_tokens: int,
                   max_batch: int) -> Iterator[list[tuple[int, int]]]:
    """Batches of (prompt index, sample index) items: prompts by length, n samples each, consecutive."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    items = [(i, j) for i in order for j in range(n)]
    pos = 0
    while pos < len(items):
        # batch size from the longest prompt in the batch (items are sorted by length)
        longest = lengths[items[min(pos + max_batch, len(items)) - 1][0]]
        bs = max(1, min(max_batch, batch_tokens // (longest + max_new_tokens)))
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


def sampling_kwargs(temperature: float, top_p: float = 1.0) -> dict:
    """transformers `generate` arguments: sampling from softmax(logits / T) (top-k off), or greedy."""
    if temperature > 0:
        return {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
