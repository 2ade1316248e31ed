"""The in-place KV cache (`deltalens.generation.kv_cache`): the same keys and values as transformers'
concatenating `DynamicLayer` through updates, row selection, repeats and crops; buffers regrown once per
segment (not copied every token); generation identical with either cache (greedy and seeded sampling,
fp32 and bf16, HF backend and ES population batching); sliding-window layers left to transformers."""

from __future__ import annotations

import platform

import pytest
import torch
from support import member_completions, small_llama, tiny_spec

from deltalens.generation import HFBackend, SamplingParams, kv_cache
from deltalens.generation import hf as hf_mod
from deltalens.generation.batching import length_batches


def plain_cache(config, reserve):
    from transformers import DynamicCache

    return DynamicCache(config=config)


def test_growing_layer_holds_what_dynamic_layer_holds():
    from transformers.cache_utils import DynamicLayer

    grow, ref = kv_cache._growing_layer_class()(reserve=3), DynamicLayer()
    g = torch.Generator().manual_seed(0)

    def step(n, rows=4):
        k, v = torch.randn(rows, 2, n, 8, generator=g), torch.randn(rows, 2, n, 8, generator=g)
        a, b = grow.update(k, v), ref.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert grow.get_seq_length() == ref.get_seq_length()

    step(5)
    first = grow._k
    for _ in range(3):
        step(1)
    assert grow._k is first  # 5 + 3 new tokens fit the reserve: written in place, no new buffer
    step(1)  # past the reserve: a larger buffer, same contents
    assert grow._k is not first and grow._k.shape[-2] == 9 + 3
    idx = torch.tensor([3, 1])
    grow.batch_select_indices(idx), ref.batch_select_indices(idx)
    step(1, rows=2)
    grow.batch_repeat_interleave(2), ref.batch_repeat_interleave(2)
    step(2, rows=4)
    grow.crop(-3), ref.crop(-3)
    assert torch.equal(grow.keys, ref.keys) and grow.get_seq_length() == ref.get_seq_length() == 9
    step(1)
    grow.reset()
    assert grow.get_seq_length() == 0 and not grow.is_initialized


def test_sliding_window_layers_are_left_to_transformers():
    from transformers import Gemma3TextConfig
    from transformers.cache_utils import DynamicLayer

    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"] * 2)
    cache = kv_cache.new_cache(cfg, reserve=10)
    kinds = [type(layer) for layer in cache.layers]
    grow = kv_cache._growing_layer_class()
    assert [issubclass(k, grow) for k in kinds] == [False, True, False, True]
    assert all(k is not DynamicLayer for k in kinds)  # nothing left concatenating where we could write in place


@pytest.fixture(scope="module")
def tiny():
    from deltalens.io.models import load_model
    from deltalens.tasks import get_task

    model, tok = load_model(tiny_spec())
    return model, tok, get_task("arith").test(12)


@pytest.mark.parametrize("params", [SamplingParams(n=1, temperature=0.0, max_new_tokens=40),
                                    SamplingParams(n=3, temperature=0.0, max_new_tokens=40),
                                    SamplingParams(n=3, temperature=1.0, max_new_tokens=40, seed=5)],
                         ids=["greedy-n1", "greedy-n3", "sampled-n3"])
def test_hf_generation_same_with_either_cache(tiny, monkeypatch, params):
    model, tok, problems = tiny
    prompts = [p.prompt for p in problems]
    ours = HFBackend(model, tok, batch_tokens=600).generate(prompts, params)
    monkeypatch.setattr(hf_mod, "new_cache", plain_cache)
    assert HFBackend(model, tok, batch_tokens=600).generate(prompts, params) == ours


def test_bf16_generation_same_with_either_cache(monkeypatch):
    model, tok = small_llama(dtype=torch.bfloat16, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    prompts = ["12+7=", "3+44=", "5+5=", "100+23="]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=1)
    ours = HFBackend(model, tok).generate(prompts, params)
    monkeypatch.setattr(hf_mod, "new_cache", plain_cache)
    assert HFBackend(model, tok).generate(prompts, params) == ours


def test_decoding_regrows_once_per_segment(tiny, monkeypatch):
    model, tok, problems = tiny
    grows = []
    layer = kv_cache._growing_layer_class()
    real = layer._grow
    monkeypatch.setattr(layer, "_grow", lambda self, *a: (grows.append(a[-1]), real(self, *a))[1])
    HFBackend(model, tok, batch_tokens=10**6).generate([p.prompt for p in problems],
                                                      SamplingParams(n=1, temperature=0.0, max_new_tokens=40))
    layers = model.config.num_hidden_layers
    # one batch, 40 new tokens, a segment (16) reserved at a time: the prefill's buffer and two regrowths
    # per layer (not one per token as a concatenating cache copies)
    assert len(grows) == 3 * layers


@pytest.mark.parametrize("noise", ["full", "lowrank"])
def test_population_batching_same_with_either_cache(tiny, monkeypatch, noise):
    """ES members generated together (`generate_replicated`, members retired between segments): the
    same completions with the in-place cache as with transformers' own."""
    from deltalens.training.es import population as pop_mod

    model, tok, _ = tiny
    ours = member_completions(model, tok, monkeypatch, noise=noise)
    monkeypatch.setattr(pop_mod, "new_cache", plain_cache)
    assert member_completions(model, tok, monkeypatch, noise=noise) == ours and len({tuple(c) for c in ours}) > 1


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim only")
def test_every_batch_gives_its_freed_memory_back(monkeypatch):
    """After each batch of HF generation and of ES population batching the heap is trimmed (glibc's
    malloc_trim), so memory freed by one batch's cache does not stay resident into the next."""
    from deltalens.io import heap

    monkeypatch.setattr(heap, "_keeping", False)  # the trimming mode (DELTALENS_MALLOC=trim)
    assert heap.release_freed_memory() is True
    calls = []
    monkeypatch.setattr(hf_mod, "release_freed_memory", lambda: calls.append("hf"))
    model, tok = small_llama(seed=0)
    be = HFBackend(model, tok, batch_tokens=40)  # a few rows per batch: several batches
    prompts, params = ["1+2=", "3+4=", "10+20=", "7+8="], SamplingParams(n=2, temperature=0.6, max_new_tokens=4)
    be.generate(prompts, params)
    batches = list(length_batches([len(e) for e in be.encode(prompts)], 2, 4, 40, be.max_batch,
                                  shared=kv_cache.can_share(model)))
    assert len(batches) >= 2 and calls == ["hf"] * len(batches)
