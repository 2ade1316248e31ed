"""HF backend: sample `n` completions per prompt from a transformers model, batched and seeded.

Every (prompt, sample) pair is decoded with a KV cache and left padding (`deltalens.generation.decode`:
the token ids transformers' `generate` computes for our arguments, without its per-step selection and
bookkeeping; a model whose generation_config adds logits processors still goes through `generate`), in
batches of a
token budget with prompts sorted by token length (`deltalens.generation.batching`), results put back in
the caller's order, each sequence stopped at EOS or at a stop string (`params.stop`, checked between
segments; the text is cut before it). Per batch (`_generate_batch`):

1. Prefill once per prompt (n > 1): a batch holds each of its prompts' samples side by side, so the
   prompt's tokens but the last go through the model once per distinct prompt (left padded, position
   ids from the mask as `generate` computes them), and decoding continues from that cache with the
   prompt's last token. Without it every sample recomputed its prompt: SmolLM2 with its chat-template
   prompts (~148 tokens) spent ~90% of its time in the prefill at 4 samples (cProfile, --limit 4
   --samples 4). The samples' rows then share the prompt's cache (`kv_cache.share_prefix`,
   `deltalens.generation.shared_prefix`): each decoding step reads a prompt's keys and values once for
   all its rows, where copying them to every row (`share_prompts=False`, and the fallback for layers
   that are not ours, such as sliding-window ones) made each step read n copies. n = 1 keeps one plain
   `generate` call, the arithmetic ES's population batching reproduces (`deltalens.training.es.population`).
2. Finished rows leave the batch: decoding runs SEGMENT new tokens per call, continuing from the
   KV cache (the same arithmetic as one call), and between calls the rows that reached EOS
   (or wrote a stop string) leave the batch and the cache. Within a call every row is computed until
   the batch's longest ends (as in `generate`): on SmolLM2 at T=1 most rows end within 20 tokens while one may run to the
   limit; on Gemma-3-270M's plain few-shot prompts every row ran to the limit before the stop string.

Greedy completions do not depend on the budget (rows are computed alike whatever the batch; checked on
tiny for budgets from one sequence to all, tests/generation/test_token_budget.py). SDPA attention is what
transformers 5 loads these models with. The KV cache is transformers' `DynamicCache` with its full-attention
layers written in place (`deltalens.generation.kv_cache`: buffers regrown once per SEGMENT tokens, no
per-step `torch.cat` of the whole cache). Sampling is `deltalens.generation.sampling`'s inverse-CDF draw
(one uniform per row, not torch.multinomial's one exponential per vocabulary entry), called directly by the
decoding loop; no per-step Python work scales with batch x vocabulary (what remains per step is a fixed number of module calls, ~5% of a tiny step
at 640 rows).

Memory: the batch's KV cache is bounded by its token budget (`batching.token_budget`: by default the
tokens whose KV cache fits in 512 MiB of the compute dtype, at most 262,144), never by problems x samples.

Compute dtype (`deltalens.generation.dtype`): with `compute_dtype` bf16 (or auto on a CPU with AMX-BF16 or AVX512-BF16
or a GPU with bf16, for models of hidden size >= 512) and fp32 weights, generation runs on a bf16 copy of
the model, cast from the fp32 master weights at the start of every `generate` call (one pass over the
weights; the masters are only read). The copy costs half the masters' memory, made on the first call and
kept.

Seeding: batch b is sampled after `torch.manual_seed(seed + b)`, so a call is reproducible for a fixed
budget; changing the budget changes which random numbers a sample sees (not its distribution), and so
does a row leaving the batch (the later draws of the batch go to fewer rows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from deltalens.errors import DeltalensError
from deltalens.generation.batching import left_pad, length_batches, token_budget
from deltalens.generation.decode import generate_or_decode, last_logits_only, mask_positions
from deltalens.generation.dtype import compute_copy, model_compute_dtype, sync_copy
from deltalens.generation.kv_cache import cache_name, can_share, new_cache, share_prefix
from deltalens.generation.params import SamplingParams, cut_at_stop, decode_completion
from deltalens.generation.prompts import Prompt, encode_prompts, format_prompt, uses_chat
from deltalens.generation.shared_prefix import shared_prompt_attention
from deltalens.io.heap import release_freed_memory

SEGMENT = 16  # new tokens per `generate` call between removals of finished rows


def ended_rows(tok, gen: torch.Tensor, stop: tuple[str, ...] = ()) -> torch.Tensor:
    """(rows,) bool: which rows of `gen` (rows, new tokens) hold EOS, or (with `stop`) a stop string in
    their text so far."""
    ended = (gen == tok.eos_token_id).any(1)
    if stop:
        for r in (~ended).nonzero().flatten().tolist():
            ended[r] = cut_at_stop(tok.decode(gen[r].tolist(), skip_special_tokens=True), stop)[1]
    return ended


def prefill_prompts(runner, ids: torch.Tensor, att: torch.Tensor, group: torch.Tensor, cache, share: bool) -> bool:
    """Prefill prompts `ids` (G rows, left padded where `att` is 0; positions from the mask as `generate`
    derives them) into `cache`, then hand row r of the batch that follows prompt group[r]: read in place
    (`kv_cache.share_prefix`) where `share` and every layer allow it, else a copy. Returns whether shared.
    (`HFBackend`'s samples of a prompt; ES's members' common prompt prefix, `training.es.population`.)"""
    runner(input_ids=ids, attention_mask=att, position_ids=mask_positions(att), use_cache=True,
           **last_logits_only(runner), **{cache_name(): cache})
    if share and share_prefix(cache, group, att.bool()):
        return True
    cache.batch_select_indices(group)
    return False


class HFBackend:
    """Batched sampling from a transformers model (`generation.decode`: KV cache, left padding, stop at EOS).

    batch_tokens bounds (sequences x (prompt + new tokens)) per forward batch, which bounds the KV cache;
    None: the tokens whose KV cache fits in `kv_bytes` of the compute dtype (`batching.token_budget`).
    chat_template: auto | on | off (`deltalens.generation.prompts`); `chat` is the resolved choice.
    compute_dtype: fp32 | bf16 | auto (`deltalens.generation.dtype`); `dtype` is the resolved torch dtype.
    `model` stays the master: a bf16 compute copy is `compute_model` (None until the first call).
    share_prompts: with n > 1, the rows of a prompt read its KV cache once per step
    (`deltalens.generation.shared_prefix`) instead of each holding a copy of it (False: the copies).
    """

    def __init__(self, model, tokenizer, batch_tokens: int | None = None, max_batch: int = 1024,
                 chat_template: str | bool = "auto", compute_dtype: str = "fp32", kv_bytes: int | None = None,
                 share_prompts: bool = True):
        self.model, self.tok = model, tokenizer
        self.share_prompts = share_prompts
        self.max_batch = max_batch
        self.chat = uses_chat(tokenizer, chat_template)
        if tokenizer.pad_token_id is None:
            raise DeltalensError("tokenizer has no pad or eos token; cannot batch generation")
        self.dtype = model_compute_dtype(compute_dtype, model)
        self.compute_model = None
        self._as_is = False  # `as_is`: generate on the compute copy without refreshing it
        if batch_tokens is None:
            batch_tokens = token_budget(getattr(model, "config", None), self.dtype,
                                        **({} if kv_bytes is None else {"kv_bytes": kv_bytes}))
        self.batch_tokens = batch_tokens

    def runner(self):
        """The module that generates: the master itself, or its compute copy refreshed from the master
        (left as it is inside `as_is`)."""
        param = next(self.model.parameters(), None)
        if param is None or self.dtype == param.dtype:
            return self.model
        if self.compute_model is None:
            self.compute_model = compute_copy(self.model, self.dtype)
        elif not self._as_is:
            sync_copy(self.model, self.compute_model)
        return self.compute_model

    @contextlib.contextmanager
    def as_is(self):
        """Within the block, `generate` runs on the compute copy as it stands, without refreshing it from
        the master: ES writes a member into the copy (`ESEngine.evaluate_members`) and leaves the master
        alone."""
        self._as_is = True
        try:
            yield
        finally:
            self._as_is = False

    def format(self, prompt: Prompt) -> str:
        return format_prompt(self.tok, prompt, self.chat)

    def encode(self, prompts: list[Prompt]) -> list[list[int]]:
        return encode_prompts(self.tok, prompts, self.chat)

    def generate(self, prompts: list[Prompt], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[list[str]]:
        """Returns out[i][j]: completion j of prompt i. `progress(k)` is called after each k sequences."""
        return [[decode_completion(self.tok, row, params.stop) for row in rows]
                for rows in self.generate_ids(self.encode(prompts), params, progress)]

    @torch.no_grad()
    def generate_ids(self, enc: list[list[int]], params: SamplingParams,
                     progress: Callable[[int], None] | None = None) -> list[list[list[int]]]:
        """out[i][j]: the new token ids of completion j of the already encoded prompt enc[i], through the
        first EOS when it has one (GRPO's rollouts keep it; `decode_completion` cuts it), and for rows
        stopped at a stop string up to SEGMENT - 1 tokens past it (`params.cut_ids_at_stop` trims them)."""
        from transformers.utils import logging as hf_logging

        out: list[list[list[int]]] = [[[] for _ in range(params.n)] for _ in enc]
        runner = self.runner()
        shared = self.share_prompts and params.n > 1 and can_share(runner)
        batches = length_batches([len(e) for e in enc], params.n, params.max_new_tokens, self.batch_tokens,
                                 self.max_batch, shared=shared)
        verbosity = hf_logging.get_verbosity()
        try:
            for b, chunk in enumerate(batches):
                torch.manual_seed(params.seed + b)
                with shared_prompt_attention(runner, shared) as on:
                    rows = self._generate_batch(runner, [i for i, _ in chunk], enc, params, share=on)
                release_freed_memory()  # the batch's cache and logits, back to the OS (`kv_cache`)
                for (i, j), row in zip(chunk, rows):
                    out[i][j] = row
                if progress is not None:
                    progress(len(chunk))
        finally:
            hf_logging.set_verbosity(verbosity)
        return out

    def _generate_batch(self, runner, owners: list[int], enc: list[list[int]], params: SamplingParams,
                        share: bool = False):
        """The new token ids (through the first EOS) of each row of one batch; row r continues prompt
        owners[r] (a prompt's rows are consecutive). share: the rows read their prompt's cache in place
        (`kv_cache.share_prefix`) where every layer allows it, else each row gets a copy."""
        from transformers.utils import logging as hf_logging

        device = next(self.model.parameters()).device
        tok, eos = self.tok, self.tok.eos_token_id
        cache = new_cache(runner.config, SEGMENT)  # written in place, room for a segment at a time (`kv_cache`)
        if params.n > 1:
            # 1. prefill each distinct prompt once, then give each of its rows a view of that cache
            distinct = list(dict.fromkeys(owners))
            ids, att = left_pad([enc[i] for i in distinct], tok.pad_token_id)  # (P, width)
            where = {i: k for k, i in enumerate(distinct)}
            expand = torch.tensor([where[i] for i in owners], device=device)  # (rows,) -> distinct prompt
            ids, att = ids.to(device), att.to(device)
            if ids.shape[1] > 1:
                prefill_prompts(runner, ids[:, :-1], att[:, :-1], expand, cache, share)
            ids, att = ids[expand], att[expand]
        else:
            ids, att = left_pad([enc[i] for i in owners], tok.pad_token_id)
            ids, att = ids.to(device), att.to(device)
        width = ids.shape[1]
        rows: list[list[int] | None] = [None] * len(owners)
        live = list(range(len(owners)))  # position in `ids` -> row of the caller's batch
        produced = 0
        while True:
            # 2. SEGMENT tokens at a time; rows that reached EOS leave the batch (and the cache) between calls
            step = min(SEGMENT, params.max_new_tokens - produced)
            seqs = generate_or_decode(runner, ids, att, cache, step, pad_token_id=tok.pad_token_id, eos_token_id=eos,
                                      temperature=params.temperature, top_p=params.top_p)
            hf_logging.set_verbosity_error()  # `generate` continuing: finished rows end in padding, which is fine
            new = seqs.shape[1] - ids.shape[1]
            ids, produced = seqs, produced + new  # the cache filled in place
            att = torch.cat([att, att.new_ones(att.shape[0], new)], dim=1)
            gen = ids[:, width:]
            ended = ended_rows(tok, gen, params.stop)
            done = torch.ones_like(ended) if produced >= params.max_new_tokens or new < step else ended
            for r in done.nonzero().flatten().tolist():
                row = gen[r].tolist()
                rows[live[r]] = row[: row.index(eos) + 1] if eos in row else row
            if bool(done.all()):
                return rows
            if bool(done.any()):
                keep = (~done).nonzero().flatten()
                live = [live[k] for k in keep.tolist()]
                ids, att = ids[keep], att[keep]
                cache.batch_select_indices(keep)
