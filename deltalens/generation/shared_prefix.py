"""Attention over a prompt shared by many rows, read once per prompt instead of once per row.

When `HFBackend` samples n completions of a prompt, the n rows attend to the same prompt keys and values.
Until 2026-12-06 the prompt's KV cache was prefilled once and then copied to every row
(`batch_select_indices`), so each decoding step read n copies of it: for SmolLM2 at 8 prompts x 8 samples
that read (~8 MB a layer and step in bf16) was the largest cost after the matmuls (SDPA 0.89 s of a 3.5 s
evaluation batch, the copies 0.13 s; benchmarks/README.md, "Shared-prompt attention").

Here the cache keeps the prompts' keys and values once, [G prompts, kv heads, P, head dim] in fp32, beside
each row's own tokens (its last prompt token and what it generated), and a decoding step (one query token
per row) computes, for row r of prompt g(r), with s = scaling:

    prefix:  s1 = s·q_r·K_g^T (masked where the prompt is left padding),  m1 = max s1,  l1 = Σ e^(s1-m1),
             o1 = Σ e^(s1-m1)·V_g           -- one [G, kv heads, rows of g x group size, P] product per step
    suffix:  s2, m2, l2, o2 the same over the row's own keys and values
    output:  (o1·e^(m1-m) + o2·e^(m2-m)) / (l1·e^(m1-m) + l2·e^(m2-m)),  m = max(m1, m2)

which is softmax attention over [prompt, own tokens] split in two (the log-sum-exp merge flash attention
uses between key blocks). The arithmetic is fp32 throughout, as torch's CPU flash kernel does for bf16
inputs, and the output is cast to the query's dtype; the summation order differs from SDPA's, so
logits agree to rounding, not bit for bit (fp32 completions identical, bf16 no further from fp32 attention than
SDPA's: tests/generation/test_shared_prefix.py).
Queries of one prompt's rows are packed into one matrix per (prompt, kv head) (rows padded to the largest
group, GQA's query heads side by side), so the prompt keys are read once per step for all its rows.

ES's population batching (`deltalens.training.es.population`) shares another prefix the same way: a
member's prompts' common tokens (chat template, few-shot examples), prefilled once per member; its rows'
own tokens then start with the rest of their prompt, prefilled in one step of several query tokens per
row, which gets SDPA over whole rows (the shared keys gathered to each row, causal over the own tokens).

Anything else (the prefill, a step with several query tokens, a cache without a shared prompt) goes to
transformers' own SDPA attention unchanged. The attention is registered with transformers as
`deltalens_sdpa` (its mask is SDPA's) and `shared_prompt_attention(model)` selects it for the duration of a
generation call. The cache side is `deltalens.generation.kv_cache` (`SharedPrefix`, `share_prefix`).
"""

from __future__ import annotations

import contextlib
import functools

import torch

NAME = "deltalens_sdpa"


class PromptRows:
    """Which prompt each row of the batch continues (`group`, [rows]), each row's slot in the packed queries,
    and the prompts' padding as a bias [G, 1, 1, P] (0 at real tokens, -inf at padding). Every layer's
    `SharedPrefix` of a cache holds the same one, so rows leaving the batch are mapped once, not per layer."""

    def __init__(self, mask: torch.Tensor, group: torch.Tensor):
        self.prompts = mask.shape[0]
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
        self.bias = bias[:, None, None, :]
        self._last = None
        self.set_group(group)

    def set_group(self, group: torch.Tensor) -> None:
        """Rows -> prompts; rows of one prompt get slots 0, 1, ... in order (`width` = the largest count)."""
        g = group.to(self.bias.device, torch.long)
        self.group = g
        counts = torch.bincount(g, minlength=self.prompts)
        self.width = max(int(counts.max()), 1) if g.numel() else 1
        starts = torch.cumsum(counts, 0) - counts  # first position of each prompt in the sorted rows
        order = torch.argsort(g, stable=True)
        rank = torch.empty_like(g)
        rank[order] = torch.arange(g.numel(), device=g.device) - starts[g[order]]
        self.slot = g * self.width + rank  # [rows]: row r's place in the [G * width] packed queries

    def select(self, indices: torch.Tensor) -> None:
        """Keep rows `indices`. The cache hands every layer the same indices tensor; it is applied once."""
        if indices is self._last:
            return
        self._last = indices
        self.set_group(self.group[indices.to(self.group.device)])


class SharedPrefix:
    """One layer's shared prompt: keys/values [G, kv heads, P, D] (fp32) and the batch's `PromptRows`
    (made from mask [G, P], True at real tokens, and group [rows] when not given)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None,
                 group: torch.Tensor | None = None, rows: PromptRows | None = None):
        self.keys, self.values = keys, values
        self.rows = rows if rows is not None else PromptRows(mask.to(keys.device), group)

    @property
    def length(self) -> int:
        return self.keys.shape[-2]

    group = property(lambda self: self.rows.group)
    slot = property(lambda self: self.rows.slot)
    width = property(lambda self: self.rows.width)
    bias = property(lambda self: self.rows.bias)

    def select(self, indices: torch.Tensor) -> None:
        self.rows.select(indices)


def _prefix_part(prefix: SharedPrefix, q: torch.Tensor, scale: float):
    """(o, m, l) of the prompt part for rows' queries q [rows, kv heads, n_rep, D] (fp32): o [rows, kvh,
    n_rep, D] unnormalised, m and l [rows, kvh, n_rep, 1]."""
    _, kvh, rep, d = q.shape
    g, w = prefix.keys.shape[0], prefix.width
    packed = q.new_zeros(g * w, kvh, rep, d)
    packed[prefix.slot] = q
    packed = packed.view(g, w, kvh, rep, d).transpose(1, 2).reshape(g, kvh, w * rep, d)
    s = torch.matmul(packed, prefix.keys.transpose(-1, -2)).mul_(scale).add_(prefix.bias)  # [G, kvh, w*rep, P]
    m = s.amax(-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).min)  # finite for an all-padding prompt
    e = s.sub_(m).exp_()
    total = e.sum(-1, keepdim=True)
    o = torch.matmul(e, prefix.values)  # [G, kvh, w*rep, D]

    def unpack(t):
        return t.view(g, kvh, w, rep, -1).transpose(1, 2).reshape(g * w, kvh, rep, -1)[prefix.slot]

    return unpack(o), unpack(m), unpack(total)


def shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: the split softmax of the module doc when `key` carries a shared
    prompt (`key._deltalens_prefix`) and there is one query token per row; SDPA otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    prefix = getattr(key, "_deltalens_prefix", None)
    if prefix is None or query.shape[2] != 1 or dropout or kwargs.get("softcap") is not None:
        if prefix is not None:  # not one token per row: give SDPA whole rows (correct, no saving)
            key, value = _whole_rows(prefix, key, value)
            attention_mask = _whole_mask(prefix, attention_mask, key.shape[-2], query.shape[2])
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    rows, heads, _, d = query.shape
    kvh = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    q = query.float().view(rows, kvh, heads // kvh, d)  # GQA: query heads of kv head i are i*rep .. i*rep+rep-1
    o1, m1, l1 = _prefix_part(prefix, q, scale)
    s2 = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale)  # [rows, kvh, rep, S]
    if attention_mask is not None:  # the rows' own part of the mask (left padding lies in the prompt)
        own = attention_mask[:, :, :, prefix.length:]
        s2 = s2.masked_fill_(~own, float("-inf")) if own.dtype == torch.bool else s2.add_(own.float())
    m2 = s2.amax(-1, keepdim=True)
    m = torch.maximum(m1, m2)
    e2 = s2.sub_(m).exp_()
    a1 = (m1 - m).exp_()
    out = o1.mul_(a1).add_(torch.matmul(e2, value.float()))
    out = out.div_(l1.mul_(a1).add_(e2.sum(-1, keepdim=True)))  # [rows, kvh, rep, D]
    return out.view(rows, 1, heads, d).to(query.dtype), None


def _whole_rows(prefix: SharedPrefix, key, value):
    k = prefix.keys[prefix.group].to(key.dtype)
    v = prefix.values[prefix.group].to(value.dtype)
    return torch.cat([k, key], dim=-2), torch.cat([v, value], dim=-2)


def _whole_mask(prefix: SharedPrefix, attention_mask, length: int, queries: int):
    """The mask over [prompt, own tokens] of whole rows: transformers' own where it made one; else the
    prompt's padding, and the own tokens causal for the `queries` last of them."""
    if attention_mask is not None:
        return attention_mask
    real = torch.isfinite(prefix.bias[prefix.group])  # [rows, 1, 1, P]
    own = length - prefix.length
    causal = torch.ones(queries, own, dtype=torch.bool, device=real.device).tril_(own - queries)  # [q, own]
    return torch.cat([real.expand(-1, -1, queries, -1), causal.expand(real.shape[0], 1, -1, -1)], dim=-1)


@functools.cache
def register() -> bool:
    """Register `NAME` with transformers (attention and mask interfaces); False where this transformers has
    no such interfaces (callers then copy the prompt's cache to every row, as before)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(NAME, shared_prefix_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return True


@contextlib.contextmanager
def shared_prompt_attention(model, on: bool = True):
    """Within the block `model` attends through `shared_prefix_attention` (its SDPA attention otherwise
    unchanged), restored after; yields whether it does (False where `on` is False, this transformers has
    no attention interfaces, or the model is not on SDPA attention)."""
    config = model.config
    before = getattr(config, "_attn_implementation", None)
    if not on or before != "sdpa" or not register():
        yield False
        return
    config._attn_implementation = NAME
    try:
        yield True
    finally:
        config._attn_implementation = before
