"""The KV cache our generation loops hand to transformers' `generate`: written in place, not concatenated.

transformers' `DynamicLayer.update` appends each step's keys and values with `torch.cat`, so every decoding
step copies the whole cache of every layer: O(T) bytes per step and O(T²) per sequence, plus a second copy
of the cache alive during each cat. A `GrowingLayer` keeps keys and values in buffers with room for
`reserve` more tokens, writes each step into the next free positions and hands attention views of the
filled part [batch, kv heads, filled, head dim]. The values attention reads are the same numbers in the
same order, so outputs do not change (greedy completions identical: tests/generation/test_kv_cache.py).

`new_cache(config, reserve)` builds transformers' own `DynamicCache` for the config and swaps its
full-attention layers (exactly `DynamicLayer`) for `GrowingLayer`s; sliding-window and other layer kinds
are left to transformers. Callers reserve one generation segment (`hf.SEGMENT`, 16 tokens): a buffer is
regrown (one copy) once per segment instead of once per token, and holds at most a segment more than the
tokens so far: reserving all of max_new_tokens up front would make every batch hold its whole token budget
from the prefill on, while most rows end long before max_new_tokens and leave the batch. Rows that leave
the batch (`batch_select_indices`) take their buffers with them (one gather, as before). Measured figures:
benchmarks/README.md ("bench_es.py").

Buffers that grow and shrink like these are served from glibc's heap once glibc has seen a chunk of their
size freed (its mmap threshold rises to it, up to 32 MiB), and a heap keeps freed pages resident until it is
trimmed: resident memory then grew from batch to batch and from one temperature to the next. Each
generation loop therefore calls `release_freed_memory()` after a batch (glibc's malloc_trim: the free
pages go back to the OS, one call per batch, not per step; a no-op under other C libraries). Fixing the
mmap threshold instead (4 MiB) bounded memory as well, but mapped the logits afresh every decoding step:
in a process that also held a vLLM engine (its NUMA memory binding) that halved HF's bf16 tokens/s.
Since 2026-12-06 the training commands keep freed memory instead (`deltalens.io.heap.keep_freed_memory`:
page faults cost tens of microseconds on the VMs we run on) and the call does nothing there;
`DELTALENS_MALLOC` chooses (auto, keep, trim).
"""

from __future__ import annotations

import functools

import torch

from deltalens.generation.shared_prefix import PromptRows, SharedPrefix, register


def cache_name() -> str:
    """transformers >= 5 calls the generate/forward cache argument `cache`; before, `past_key_values`."""
    from transformers.utils import generic

    return "cache" if hasattr(generic, "_rename_kwargs_for_bc") else "past_key_values"


@functools.cache
def _growing_layer_class():
    """The GrowingLayer class, made once on first use (transformers is imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A `DynamicLayer` whose keys/values are views of buffers with room for `reserve` more tokens."""

        def __init__(self, reserve: int = 0, **kwargs):
            super().__init__(**kwargs)
            self.reserve = max(0, int(reserve))  # spare positions allocated at each (re)allocation
            self._k = self._v = None
            self._n = 0
            self.prefix = None  # a SharedPrefix (`share_prefix`): the prompts' tokens, once per prompt

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, new = self._n, key_states.shape[-2]
            if self._k is None or n + new > self._k.shape[-2]:
                self._grow(key_states, value_states, n + new + self.reserve)
            self._k[:, :, n:n + new] = key_states
            self._v[:, :, n:n + new] = value_states
            self._n = n + new
            self.keys, self.values = self._k[:, :, :self._n], self._v[:, :, :self._n]
            if self.prefix is not None:  # the rows' own tokens; the attention finds the prompt's on the keys
                self.keys._deltalens_prefix = self.prefix
            return self.keys, self.values

        def share(self, group: torch.Tensor, mask: torch.Tensor, rows: PromptRows | None = None) -> None:
            """Make what the cache holds (one row per prompt, [G, kv heads, P, D]) the shared prompt of rows
            continuing prompt group[r] (mask [G, P]: True at real tokens; `rows`: the map the cache's other
            layers hold, when there is one); the rows' own tokens start empty."""
            keys, values = self._k[:, :, :self._n].float(), self._v[:, :, :self._n].float()
            self.prefix = SharedPrefix(keys, values, mask, group, rows=rows)
            self._k = self._v = None
            self._n = 0
            self.keys, self.values = keys[:0], values[:0]

        def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
            b, h, _, dk = key_states.shape
            k = key_states.new_empty((b, h, capacity, dk))
            v = value_states.new_empty((b, h, capacity, value_states.shape[-1]))
            if self._n:
                k[:, :, :self._n] = self._k[:, :, :self._n]
                v[:, :, :self._n] = self._v[:, :, :self._n]
            self._k, self._v = k, v

        def get_seq_length(self) -> int:
            if not self.is_initialized:
                return 0
            return self._n + (self.prefix.length if self.prefix is not None else 0)

        def reset(self) -> None:
            self._k = self._v = None
            self._n = 0
            self.prefix = None
            super().reset()

        def crop(self, tokens_to_remove: int) -> None:
            if self.prefix is not None:
                raise NotImplementedError("crop of a cache with a shared prompt")
            super().crop(tokens_to_remove)  # checks the argument; keys/values become the shorter views
            if self.is_initialized and tokens_to_remove:
                self._n = self.keys.shape[-2]

        def _select(self, fn, rows: torch.Tensor | None) -> None:
            if self.is_initialized and self._k is not None:
                self._k, self._v = fn(self._k), fn(self._v)
                self.keys, self.values = self._k[:, :, :self._n], self._v[:, :, :self._n]
            if self.prefix is not None:
                self.prefix.select(rows)

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._select(lambda t: t[indices.to(t.device)], indices)

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.prefix is not None:  # the layers share one row map, and an int gives no indices to apply once
                raise NotImplementedError("batch_repeat_interleave of a cache with a shared prompt")
            self._select(lambda t: t.repeat_interleave(repeats, dim=0), None)

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            self._select(lambda t: t.index_select(0, beam_idx.to(t.device)), beam_idx)

    return GrowingLayer


def new_cache(config, reserve: int):
    """An empty `DynamicCache` for `config` whose full-attention layers write in place (`GrowingLayer`) with
    room for `reserve` tokens beyond whatever the first update brings."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layer = functools.partial(_growing_layer_class(), reserve=reserve)
    cache = DynamicCache(config=config)
    cache.layers = [layer() if type(old) is DynamicLayer else old for old in cache.layers]
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = layer
    return cache


def share_prefix(cache, group: torch.Tensor, mask: torch.Tensor) -> bool:
    """After a prefill of G prompts (one cache row each, `mask` [G, P] their padding), let the rows of the
    batch that follows share them: row r continues prompt group[r], and attention reads each prompt once
    per step (`deltalens.generation.shared_prefix`). False, with the cache unchanged, where a layer is not
    ours (sliding-window and other kinds): the caller then copies the prompts to the rows."""
    growing = _growing_layer_class()
    if not all(type(layer) is growing and layer.is_initialized for layer in cache.layers):
        return False
    rows = PromptRows(mask, group)  # one row map for every layer
    for layer in cache.layers:
        layer.share(group, mask, rows=rows)
    return True


def can_share(model) -> bool:
    """Whether `share_prefix` will take every layer of `model`'s cache: SDPA attention (which
    `shared_prefix` extends), a transformers with attention interfaces, and only full-attention layers."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not register():
        return False
    growing = _growing_layer_class()
    return all(type(layer) is growing for layer in new_cache(model.config, 0).layers)
