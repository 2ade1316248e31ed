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
            return self.keys, self.values

        def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
            b, h, _, dk = key_states.shape
            k = key_states.new_empty((b, h, capacity, dk))
            v = value_states.new_empty((b, h, capacity, value_states.shape[-1]))
            if self._n:
                k[:, :, :self._n] = self._k[:, :, :self._n]
                v[:, :, :self._n] = self._v[:, :, :self._n]
            self._k, self._v = k, v

        def get_seq_length(self) -> int:
            return self._n if self.is_initialized else 0

        def reset(self) -> None:
            self._k = self._v = None
            self._n = 0
            super().reset()

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)  # checks the argument; keys/values become the shorter views
            if self.is_initialized and tokens_to_remove:
                self._n = self.keys.shape[-2]

        def _select(self, fn) -> None:
            if self.is_initialized and self._k is not None:
                self._k, self._v = fn(self._k), fn(self._v)
                self.keys, self.values = self._k[:, :, :self._n], self._v[:, :, :self._n]

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._select(lambda t: t[indices.to(t.device)])

        def batch_repeat_interleave(self, repeats: int) -> None:
            self._select(lambda t: t.repeat_interleave(repeats, dim=0))

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

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
