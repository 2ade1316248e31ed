"""HF backend: sample `n` completions per prompt with transformers' `generate`, batched and seeded.

Every (prompt, sample) pair goes through `generate` with a KV cache and left padding, prompts of equal
token length batched together (`deltalens.generation.batching`), each sequence stopped at EOS.

Seeding: batch b is sampled after `torch.manual_seed(seed + b)`, so a call is reproducible for a fixed
batch size; changing the batch size changes which random numbers a sample sees (not its distribution).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltalens.errors import DeltalensError
from deltalens.generation.batching import left_pad, length_batches, sampling_kwargs
from deltalens.generation.params import SamplingParams
from deltalens.generation.prompts import Prompt, encode_prompts, format_prompt, uses_chat


class HFBackend:
    """Batched sampling with transformers `generate` (KV cache, left padding, stop at EOS).

    batch_tokens bounds (sequences x (prompt + new tokens)) per forward batch, which bounds the KV cache.
    chat_template: auto | on | off (`deltalens.generation.prompts`); `chat` is the resolved choice.
    """

    def __init__(self, model, tokenizer, batch_tokens: int = 262_144, max_batch: int = 1024,
                 chat_template: str | bool = "auto"):
        self.model, self.tok = model, tokenizer
        self.batch_tokens, self.max_batch = batch_tokens, max_batch
        self.chat = uses_chat(tokenizer, chat_template)
        if tokenizer.pad_token_id is None:
            raise DeltalensError("tokenizer has no pad or eos token; cannot batch generation")

    def format(self, prompt: Prompt) -> str:
        return format_prompt(self.tok, prompt, self.chat)

    def encode(self, prompts: list[Prompt]) -> list[list[int]]:
        return encode_prompts(self.tok, prompts, self.chat)

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[list[str]]:
        """Returns out[i][j]: completion j of prompt i. `progress(k)` is called after each k sequences."""
        enc = self.encode(prompts)
        out: list[list[str]] = [[""] * params.n for _ in prompts]
        device = next(self.model.parameters()).device
        eos = self.tok.eos_token_id
        kw = sampling_kwargs(params.temperature, params.top_p)
        batches = length_batches([len(e) for e in enc], params.n, params.max_new_tokens, self.batch_tokens,
                                 self.max_batch)
        for b, chunk in enumerate(batches):
            ids, att = left_pad([enc[i] for i, _ in chunk], self.tok.pad_token_id)
            T = ids.shape[1]
            torch.manual_seed(params.seed + b)
            gen = self.model.generate(
                input_ids=ids.to(device), attention_mask=att.to(device), max_new_tokens=params.max_new_tokens,
                pad_token_id=self.tok.pad_token_id, eos_token_id=eos, **kw,
            )[:, T:].cpu()
            for r, (i, j) in enumerate(chunk):
                row = gen[r].tolist()
                if eos in row:
                    row = row[: row.index(eos)]
                out[i][j] = self.tok.decode(row, skip_special_tokens=True)
            if progress is not None:
                progress(len(chunk))
        return out
