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
   `max`'s indices: the same first index on ties, 12.6 ms against argmax's 34.2 ms on [214, 49,152] bf16
   at one thread, benchmarks/bench_decode_pieces.py), or `sampling.draw` (the inverse-CDF draw, after
   temperature and top-p where set: the same numbers and random stream as our processors inside
   `generate`); a row that has written EOS gets padding from then on;
4. stop when every row has written EOS or after `max_new_tokens`.

Why not `generate`: at `deltalens eval`'s batch shape (SmolLM2 bf16, 214 rows x 49,152 vocabulary, one
thread) its selection cost ~35 ms a step on top of our draw: the processors must hand back a [rows, V]
score tensor (filled with -inf but for the drawn token) that `generate` then argmaxes (29.6 ms a step,
a one-off torch dispatch timing by op and shape with generation_op_times.py's timer, not kept), and greedy decoding copied the logits to fp32
(~24 ms) before its argmax; plus its per-step bookkeeping.

Settings of the model's own `generation_config` that change what `generate` computes for our call (a
repetition penalty, beams, a minimum length, suppressed or forced tokens, assisted decoding, ...) are not
reproduced here, nor a model class's own generation hooks: `generate_or_decode` hands such a model to
`generate`, as before (`generate_settings` says why), so no setting is silently dropped.
"""

from __future__ import annotations

import functools
import inspect

import torch

from deltalens.generation.kv_cache import cache_name
from deltalens.generation.sampling import draw, sampling_kwargs

# generation_config fields `decode_segment` may leave at any value: what our call sets or overrides (token
# ids, lengths, the sampling settings, which `generate` does not apply with our do_sample=False), what only
# shapes `generate`'s return value or its speed, and settings of modes our call never selects (beam search's
# length penalty, ...). Any other field away from its default (a repetition penalty, beams, a minimum
# length, suppressed tokens, assisted decoding, `use_cache` off, ...) sends the model to `generate`.
_FREE_FIELDS = frozenset({
    "pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id", "_from_model_config",
    "transformers_version", "max_length", "max_new_tokens", "do_sample", "temperature", "top_p", "top_k",
    "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "output_attentions", "output_hidden_states",
    "output_scores", "output_logits", "return_dict_in_generate", "length_penalty", "early_stopping",
    "diversity_penalty", "compile_config", "disable_compile",
})


# values that leave `generate`'s greedy decoding as it is (transformers 5 defaults these fields to None)
_NEUTRAL = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "num_beams": 1, "num_beam_groups": 1,
            "num_return_sequences": 1, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "min_length": 0,
            "min_new_tokens": 0, "renormalize_logits": False, "remove_invalid_values": False, "guidance_scale": 1.0,
            "use_cache": True, "token_healing": False, "low_memory": False}


def generate_settings(model) -> list[str]:
    """What `decode_segment` would not reproduce for this model (empty: it can stand in for `generate`):
    the fields of `model.generation_config` away from their defaults (and from `_NEUTRAL`'s values) outside
    `_FREE_FIELDS`, and a model class with generation hooks of its own (`prepare_inputs_for_generation` overridden, or
    a forward without `position_ids` / `attention_mask`)."""
    out = []
    cfg = getattr(model, "generation_config", None)
    if cfg is not None:
        diff = cfg.to_diff_dict()
        out += sorted(k for k, v in diff.items()
                      if k not in _FREE_FIELDS and not (k in _NEUTRAL and v == _NEUTRAL[k]))
    return out + _class_hooks(type(model))


@functools.cache
def _class_hooks(cls) -> list[str]:
    """A model class's own generation hooks, which `decode_segment` does not reproduce (checked once per
    class: `generate_or_decode` asks every segment)."""
    from transformers.generation.utils import GenerationMixin

    out = []
    if getattr(cls, "prepare_inputs_for_generation", None) is not GenerationMixin.prepare_inputs_for_generation:
        out.append(f"{cls.__name__}.prepare_inputs_for_generation")
    if not {"position_ids", "attention_mask"} <= set(inspect.signature(cls.forward).parameters):
        out.append(f"{cls.__name__}.forward without position_ids or attention_mask")
    return out


@functools.cache
def keeps_logits(cls) -> bool:
    """Whether the model class's forward takes `logits_to_keep` (as `generate` checks)."""
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def last_logits_only(model) -> dict:
    """The forward keyword that computes logits at the last position only (`logits_to_keep=1`), or
    nothing for a model whose forward lacks it (its logits then cover every position)."""
    return {"logits_to_keep": 1} if keeps_logits(type(model)) else {}


def mask_positions(att: torch.Tensor) -> torch.Tensor:
    """[rows, width] position ids of left-padded rows, from their attention mask as `generate` derives
    them: cumsum - 1, padding at 0."""
    return (att.long().cumsum(-1) - 1).masked_fill(att == 0, 0)


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
    pos = mask_positions(att)
    mask = None if bool((att == 1).all()) else att
    tokens, pos = input_ids[:, cached:], pos[:, cached:]
    unfinished = torch.ones(rows, dtype=torch.long, device=input_ids.device)
    pad = torch.tensor(pad_token_id, device=input_ids.device)
    out = [input_ids]
    extra = {cache_name(): cache, **last_logits_only(model)}
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
    res = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                         pad_token_id=pad_token_id, eos_token_id=eos_token_id, return_dict_in_generate=True,
                         **{cache_name(): cache}, **sampling_kwargs(temperature, top_p))
    return res.sequences
