"""One segment of decoding with a KV cache: what `model.generate(...).sequences` returns, without `generate`.

Our generation loops (`hf.HFBackend`, `training.es.population.generate_replicated`) call this once per
segment of new tokens, continuing from the cache the previous segment filled. It computes what transformers'
`generate` computes for our arguments (greedy selection over `sampling.sampling_kwargs`'s processors,
`pad_token_id`, one `eos_token_id`, a user cache, `max_new_tokens`), step by step:

1. at the segment's start, positions from the 2D attention mask (cumsum - 1, padding at 0) and the mask
   itself dropped when it is all ones (both as `generate` does: the model then builds its causal mask alone);
2. the first forward takes the tokens the cache does not hold (input_ids[:, cached:]), each later one the
   last token, with positions counting on and the mask grown by a column a step; `logits_to_keep=1`;
3. the next token: the logits' argmax (greedy; read in their own dtype, bf16 -> fp32 being exact, through
   `max`'s indices: the same first index on ties, 15.4 ms against argmax's 40.8 ms on [214, 49,152] bf16
   at one thread), or `sampling.draw` (the inverse-CDF draw, after temperature and top-p where set: the
   same numbers and random stream as our processors inside `generate`); a row that has written EOS gets
   padding from then on;
4. stop when every row has written EOS or after `max_new_tokens`.

Why not `generate`: at `deltalens eval`'s batch shape (SmolLM2 bf16, 214 rows x 49,152 vocabulary, one
thread) its selection cost ~35 ms a step on top of our draw: the processors must hand back a [rows, V]
score tensor (filled with -inf but for the drawn token) that `generate` then argmaxes (29.6 ms a step,
torch dispatch timing, benchmarks/generation_op_times.py), and greedy decoding copied the logits to fp32
(~24 ms) before its argmax; plus its per-step bookkeeping.

Settings of the model's own `generation_config` that would add logits processors (a repetition penalty, a
minimum length, suppressed or forced tokens, ...) are not reproduced here: `generate_or_decode` hands such
a model to `generate`, as before, so no setting is silently dropped.
"""

from __future__ import annotations

import functools
import inspect

import torch

from deltalens.generation.kv_cache import cache_name
from deltalens.generation.sampling import draw

# generation_config fields whose non-default values make `generate` add logits processors for greedy
# selection (what our calls use); `decode_segment` reproduces none of them
_PROCESSOR_FIELDS = {
    "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "min_length": (None, 0),
    "min_new_tokens": (None, 0), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,), "forced_eos_token_id": (None,), "sequence_bias": (None,),
    "exponential_decay_length_penalty": (None,), "renormalize_logits": (None, False), "guidance_scale": (None, 1.0),
    "watermarking_config": (None,), "stop_strings": (None,), "prefill_chunk_size": (None,),
}


def generate_settings(model) -> list[str]:
    """The fields of `model.generation_config` that `decode_segment` does not reproduce (empty: it can
    stand in for `generate`)."""
    cfg = getattr(model, "generation_config", None)
    if cfg is None:
        return []
    return [k for k, neutral in _PROCESSOR_FIELDS.items() if getattr(cfg, k, None) not in neutral]


@functools.cache
def _keeps_logits(cls) -> bool:
    """Whether the model class's forward takes `logits_to_keep` (as `generate` checks)."""
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


@torch.no_grad()
def decode_segment(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache, max_new_tokens: int, *,
                   pad_token_id: int, eos_token_id: int, temperature: float = 0.0,
                   top_p: float = 1.0) -> torch.Tensor:
    """[rows, width + new] token ids: input_ids ([rows, width], left padded where attention_mask is 0)
    continued by up to `max_new_tokens` tokens, fewer when every row has written EOS; `cache` holds the
    first cache.get_seq_length() positions of every row and is filled in place. Rows that wrote EOS
    continue with `pad_token_id`. temperature 0: greedy; else `sampling.draw` with the global generator."""
    rows = input_ids.shape[0]
    cached = cache.get_seq_length()
    att = attention_mask
    pos = (att.long().cumsum(-1) - 1).masked_fill(att == 0, 0)
    mask = None if bool((att == 1).all()) else att
    tokens, pos = input_ids[:, cached:], pos[:, cached:]
    unfinished = torch.ones(rows, dtype=torch.long, device=input_ids.device)
    pad = torch.tensor(pad_token_id, device=input_ids.device)
    out = [input_ids]
    extra = {cache_name(): cache, **({"logits_to_keep": 1} if _keeps_logits(type(model)) else {})}
    buf = None
    for step in range(max_new_tokens):
        logits = model(input_ids=tokens.contiguous(), attention_mask=mask, position_ids=pos.contiguous(),
                       use_cache=True, return_dict=True, **extra).logits[:, -1]
        if temperature > 0:
            if buf is None:  # one fp32 buffer for the segment's scores (`sampling.draw`)
                buf = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
            nxt = draw(logits, temperature, top_p, out=buf)
        else:  # max's indices: argmax's (the first on ties) at half its time on the CPU
            nxt = logits.max(-1).indices
        nxt = nxt * unfinished + pad * (1 - unfinished)
        out.append(nxt[:, None])
        unfinished = unfinished & (nxt != eos_token_id).long()
        if step + 1 == max_new_tokens or not bool(unfinished.any()):
            break
        tokens, pos = nxt[:, None], pos[:, -1:] + 1
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        del logits
    return torch.cat(out, dim=1)


def generate_or_decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache, max_new_tokens: int, *,
                       pad_token_id: int, eos_token_id: int, temperature: float = 0.0,
                       top_p: float = 1.0) -> torch.Tensor:
    """`decode_segment`, or transformers' `generate` (with `sampling.sampling_kwargs`) for a model whose
    generation_config sets what `decode_segment` does not reproduce (`generate_settings`): the same
    sequences either way."""
    if not generate_settings(model):
        return decode_segment(model, input_ids, attention_mask, cache, max_new_tokens, pad_token_id=pad_token_id,
                              eos_token_id=eos_token_id, temperature=temperature, top_p=top_p)
    from deltalens.generation.sampling import sampling_kwargs

    res = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                         pad_token_id=pad_token_id, eos_token_id=eos_token_id, return_dict_in_generate=True,
                         **{cache_name(): cache}, **sampling_kwargs(temperature, top_p))
    return res.sequences
