"""Generation backends: sample `n` completions per prompt, batched, seeded.

The interface is one method, `generate(prompts, params) -> list[list[str]]` (outer: prompts, inner: the
`params.n` completions of that prompt, prompt text excluded). The `hf` backend batches every
(prompt, sample) pair through transformers' `generate` with a KV cache and left padding, groups prompts
of equal token length so little padding is computed, and stops each sequence at EOS. A vLLM backend can
sits behind the same interface (`deltalens.vllm_backend.VLLMBackend`, `--backend vllm`).

Seeding: batch b is sampled after `torch.manual_seed(seed + b)`, so a call is reproducible for a fixed
batch size; changing the batch size changes which random numbers a sample sees (not its distribution).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from deltalens.errors import DeltalensError


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 0.6  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0

    def __post_init__(self):
        if self.n < 1:
            raise DeltalensError(f"samples must be >= 1 (got {self.n})")
        if self.temperature < 0:
            raise DeltalensError(f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy")
        if not 0 < self.top_p <= 1:
            raise DeltalensError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.max_new_tokens < 1:
            raise DeltalensError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")


class GenerationBackend(Protocol):
    def generate(self, prompts: list[str], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[list[str]]: ...


class HFBackend:
    """Batched sampling with transformers `generate` (KV cache, left padding, stop at EOS).

    batch_tokens bounds (sequences x (prompt + new tokens)) per forward batch, which bounds the KV cache
    memory: ~ 2 * layers * kv_dim * batch_tokens * 4 bytes (fp32).
    """

    def __init__(self, model, tokenizer, batch_tokens: int = 262_144, max_batch: int = 1024,
                 chat_template: bool = False):
        self.model, self.tok = model, tokenizer
        self.batch_tokens, self.max_batch = batch_tokens, max_batch
        self.chat_template = chat_template
        if tokenizer.pad_token_id is None:
            raise DeltalensError("tokenizer has no pad or eos token; cannot batch generation")

    def format(self, prompt: str) -> str:
        if self.chat_template:
            msgs = [{"role": "user", "content": prompt}]
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return prompt

    @torch.no_grad()
    def generate(self, prompts: list[str], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[list[str]]:
        """Returns out[i][j]: completion j of prompt i. `progress(k)` is called after each k sequences."""
        enc = [self.tok(self.format(p), add_special_tokens=not self.chat_template)["input_ids"] for p in prompts]
        # Work items: (prompt index, sample index), grouped by prompt length so batches need little padding.
        order = sorted(range(len(prompts)), key=lambda i: (len(enc[i]), i))
        items = [(i, j) for i in order for j in range(params.n)]
        out: list[list[str]] = [[""] * params.n for _ in prompts]
        device = next(self.model.parameters()).device
        eos = self.tok.eos_token_id
        pos = 0
        b = 0
        while pos < len(items):
            # batch size from the longest prompt in the batch (items are sorted by length)
            longest = len(enc[items[min(pos + self.max_batch, len(items)) - 1][0]])
            bs = max(1, min(self.max_batch, self.batch_tokens // (longest + params.max_new_tokens)))
            chunk = items[pos: pos + bs]
            T = max(len(enc[i]) for i, _ in chunk)
            ids = torch.full((len(chunk), T), self.tok.pad_token_id, dtype=torch.long)
            att = torch.zeros((len(chunk), T), dtype=torch.long)
            for r, (i, _) in enumerate(chunk):
                ids[r, T - len(enc[i]):] = torch.tensor(enc[i])
                att[r, T - len(enc[i]):] = 1
            torch.manual_seed(params.seed + b)
            if params.temperature > 0:
                kw = {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
            else:
                kw = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
            gen = self.model.generate(
                input_ids=ids.to(device), attention_mask=att.to(device), max_new_tokens=params.max_new_tokens,
                pad_token_id=self.tok.pad_token_id, eos_token_id=eos, **kw,
            )[:, T:].cpu()
            for r, (i, j) in enumerate(chunk):
                row = gen[r].tolist()
                if eos in row:
                    row = row[: row.index(eos)]
                out[i][j] = self.tok.decode(row, skip_special_tokens=True)
            pos += len(chunk)
            b += 1
            if progress is not None:
                progress(len(chunk))
        return out


BACKENDS = {"hf": HFBackend, "vllm": None}  # vllm: deltalens.vllm_backend.VLLMBackend (GPU machines)


def make_backend(name: str, model, tokenizer, **kw) -> GenerationBackend:
    if name == "vllm":
        from deltalens.vllm_backend import VLLMBackend  # imports vllm lazily; clear error without it

        return VLLMBackend.from_model(model, tokenizer, **kw)
    if name not in BACKENDS:
        raise DeltalensError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name](model, tokenizer, **kw)
