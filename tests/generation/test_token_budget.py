"""Token-budget batching: every (prompt, sample) item exactly once, batches within the budget and sorted by
prompt length, and greedy completions identical whatever the budget (one sequence per batch included),
returned in the caller's order."""

from __future__ import annotations

import pytest
from support import tiny_spec

from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation.batching import length_batches


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
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=16)
    # budget 1: every sequence alone, unpadded: the reference
    alone = HFBackend(model, tok, batch_tokens=1).generate(prompts, params)
    assert all(c[0] == c[1] for c in alone) and len({c[0] for c in alone}) > 1
    for budget in (40, 120, 262_144):
        assert HFBackend(model, tok, batch_tokens=budget).generate(prompts, params) == alone, budget
    # in the caller's order: each prompt on its own gives its own row
    for p, comps in list(zip(prompts, alone))[:2]:
        assert HFBackend(model, tok).generate([p], params)[0] == comps
