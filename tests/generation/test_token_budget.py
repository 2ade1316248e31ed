"""Token-budget batching: every (prompt, sample) item exactly once, batches within the budget and sorted by
prompt length, and greedy completions identical whatever the budget (one sequence per batch included),
returned in the caller's order; the default budget is the tokens whose KV cache fits the byte budget;
a prompt is prefilled once for all its samples; finished rows leave the batch; sampling is seeded."""

from __future__ import annotations

import pytest
from support import tiny_spec

from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation import hf as hf_mod
from deltalens.generation.batching import MAX_BATCH_TOKENS, kv_bytes_per_token, length_batches, token_budget
from deltalens.generation.kv_cache import cache_name


@pytest.mark.parametrize("budget", [1, 50, 333, 10_000])
def test_length_batches_cover_every_item_once_within_the_budget(budget):
    lengths = [7, 3, 12, 3, 9, 1, 12]
    n, new = 3, 10
    batches = list(length_batches(lengths, n, new, budget, max_batch=8))
    items = [it for b in batches for it in b]
    assert sorted(items) == [(i, j) for i in range(len(lengths)) for j in range(n)]
    assert [lengths[i] for i, _ in items] == sorted(lengths[i] for i, _ in items)  # sorted by prompt length
    for b in batches:
        assert len(b) <= 8
        assert len(b) == 1 or len(b) * (max(lengths[i] for i, _ in b) + new) <= budget
    if budget == 1:
        assert all(len(b) == 1 for b in batches)


@pytest.fixture(scope="module")
def tiny():
    import torch

    from deltalens.io.models import load_model
    from deltalens.tasks import get_task

    model, tok = load_model(tiny_spec())
    problems = get_task("arith").test(8)
    # not in length order, so batches are not in the caller's order
    prompts = sorted((p.prompt for p in problems), key=lambda s: (-len(s), s))[::2] + \
        [p.prompt for p in problems][1::2]
    assert len({len(tok(p)["input_ids"]) for p in prompts}) > 2  # several prompt lengths: left padding
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny generate calls: a thread team only waits on a busy machine
    yield model, tok, prompts
    torch.set_num_threads(threads)


def test_greedy_outputs_identical_for_any_token_budget(tiny):
    model, tok, prompts = tiny
    # 40 new tokens: past SEGMENT (16), so rows leave their batch between `generate` calls
    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=40)
    longest = max(len(tok(p)["input_ids"]) for p in prompts) + params.max_new_tokens
    # budget 1: every sequence alone, unpadded: the reference
    alone = HFBackend(model, tok, batch_tokens=1).generate(prompts, params)
    assert all(len(set(c)) == 1 for c in alone) and len({c[0] for c in alone}) > 1
    assert len({len(c[0]) for c in alone}) > 1  # rows end at different steps
    # 2 sequences, 2 prompts' samples, half, all of them in one batch
    for budget in (2 * longest, 6 * longest, 12 * longest, 262_144):
        assert HFBackend(model, tok, batch_tokens=budget).generate(prompts, params) == alone, budget
    # n = 1 (one plain `generate`, no shared prefill) decodes the same
    one = HFBackend(model, tok, batch_tokens=262_144).generate(prompts, SamplingParams(n=1, temperature=0.0,
                                                                                       max_new_tokens=40))
    assert [c[0] for c in one] == [c[0] for c in alone]
    # in the caller's order: each prompt on its own gives its own row
    for p, comps in list(zip(prompts, alone))[:2]:
        assert HFBackend(model, tok).generate([p], params)[0] == comps


def test_sampled_outputs_are_seeded_for_a_fixed_budget(tiny):
    model, tok, prompts = tiny
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=3)
    be = HFBackend(model, tok, batch_tokens=200)
    first = be.generate(prompts, params)
    assert be.generate(prompts, params) == first
    assert HFBackend(model, tok, batch_tokens=200).generate(prompts, params) == first
    assert len({c for cs in first for c in cs}) > len(prompts)  # samples of a prompt differ
    other = be.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=4))
    assert other != first


def test_prompt_prefilled_once_and_finished_rows_leave_the_batch(tiny, monkeypatch):
    model, tok, prompts = tiny
    calls = []  # (rows, input width, cache length) of each model call
    forward = type(model).forward

    def spy(self, input_ids=None, **kw):
        cache = kw.get(cache_name())
        calls.append((input_ids.shape[0], input_ids.shape[1], cache.get_seq_length() if cache is not None else 0))
        return forward(self, input_ids=input_ids, **kw)

    monkeypatch.setattr(type(model), "forward", spy)
    params = SamplingParams(n=5, temperature=0.0, max_new_tokens=40)
    out = HFBackend(model, tok, batch_tokens=262_144).generate(prompts[:2], params)
    width = max(len(tok(p)["input_ids"]) for p in prompts[:2])
    # one prefill of the 2 distinct prompts (all but their last token), then 10 rows from their cache
    assert calls[0] == (2, width - 1, 0)
    assert calls[1] == (10, 1, width - 1)
    assert out == HFBackend(model, tok, batch_tokens=1).generate(prompts[:2], params)
    # sampled rows end at different steps: those that ended stop costing compute (4-token segments, so
    # tiny's rows, which end within ~10 tokens of each other, end in different segments)
    monkeypatch.setattr(hf_mod, "SEGMENT", 4)
    calls.clear()
    out = HFBackend(model, tok).generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=60))
    rows = [r for r, w, _ in calls if w == 1]  # the decoding steps
    assert rows == sorted(rows, reverse=True) and rows[0] == 2 * len(prompts) and 0 < rows[-1] < rows[0], rows
    ends = sorted(len(c) for cs in out for c in cs)
    assert ends[0] < ends[-1]


def test_default_budget_bounds_the_kv_cache():
    import torch
    from support import small_llama

    model, tok = small_llama(hidden=64, layers=3, heads=4, kv_heads=2)
    # 2 (K, V) x 3 layers x 2 KV heads x 16 head size x 4 bytes
    assert kv_bytes_per_token(model.config) == 2 * 3 * 2 * 16 * 4 == 768
    assert kv_bytes_per_token(model.config, torch.bfloat16) == 384
    assert token_budget(model.config, kv_bytes=768 * 1000) == 1000
    assert token_budget(model.config, kv_bytes=10) == 1  # below one token: batches of one sequence
    assert token_budget(model.config, kv_bytes=2**40) == MAX_BATCH_TOKENS
    assert HFBackend(model, tok, kv_bytes=768 * 1000).batch_tokens == 1000
    assert HFBackend(model, tok, kv_bytes=768 * 1000, compute_dtype="bf16").batch_tokens == 2000
    assert HFBackend(model, tok, batch_tokens=77).batch_tokens == 77  # an explicit budget is kept
    assert HFBackend(model, tok).batch_tokens == min(MAX_BATCH_TOKENS, 512 * 2**20 // 768)
