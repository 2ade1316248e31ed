"""Shared-prompt attention (`deltalens.generation.shared_prefix`, `kv_cache.share_prefix`): the split
softmax equals SDPA over each row's whole [prompt, own tokens] (padding, GQA, unequal groups after rows
leave, a prompt that is all padding); HF generation with shared prompts gives the completions of the
copied cache (fp32: identical, greedy and seeded sampling, rows leaving between segments); the sharing is
really taken; the model's attention setting is restored; layers that are not ours keep the copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import small_llama, tiny_spec

from deltalens.generation import HFBackend, SamplingParams, kv_cache, shared_prefix
from deltalens.generation import hf as hf_mod


class _Module:
    num_key_value_groups = 3
    is_causal = True


def _reference(q, pk, pv, pmask, group, sk, sv, smask, scale):
    """SDPA over whole rows: the prompt's keys copied to each row, then the row's own."""
    k = torch.cat([pk[group], sk], dim=-2)
    v = torch.cat([pv[group], sv], dim=-2)
    mask = torch.cat([pmask[group], smask], dim=-1)[:, None, None, :]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("select", [None, [0, 2, 3, 6]], ids=["whole-groups", "rows-left"])
def test_split_softmax_equals_sdpa_over_whole_rows(select):
    g = torch.Generator().manual_seed(0)
    G, kvh, rep, P, S, D = 3, 2, 3, 7, 4, 16
    pk, pv = torch.randn(G, kvh, P, D, generator=g), torch.randn(G, kvh, P, D, generator=g)
    pmask = torch.ones(G, P, dtype=torch.bool)
    pmask[1, :3] = False  # left padding
    pmask[2, :] = False  # a one-token prompt: nothing shared, only its own last token
    group = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    prefix = shared_prefix.SharedPrefix(pk, pv, pmask, group)
    if select is not None:
        prefix.select(torch.tensor(select))
        group = group[select]
    rows = group.numel()
    q = torch.randn(rows, kvh * rep, 1, D, generator=g)
    sk, sv = torch.randn(rows, kvh, S, D, generator=g), torch.randn(rows, kvh, S, D, generator=g)
    smask = torch.ones(rows, S, dtype=torch.bool)
    sk._deltalens_prefix = prefix
    mask = torch.cat([pmask[group], smask], -1)[:, None, None, :]
    ours, _ = shared_prefix.shared_prefix_attention(_Module(), q, sk, sv, mask, scaling=0.25)
    ref = _reference(q, pk, pv, pmask, group, sk, sv, smask, 0.25)
    assert ours.shape == (rows, 1, kvh * rep, D)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    ours_none, _ = shared_prefix.shared_prefix_attention(_Module(), q, sk, sv, None, scaling=0.25)
    torch.testing.assert_close(ours_none, ref, rtol=1e-5, atol=1e-6)  # no mask given: the prompt's own


def test_several_query_tokens_get_whole_rows_causally():
    """A step with several query tokens per row (ES's rows prefilling their own rest after a shared prefix):
    SDPA over whole rows, causal over the own tokens, also when transformers gives no mask."""
    g = torch.Generator().manual_seed(2)
    G, kvh, rep, P, S, D = 2, 1, 3, 5, 4, 8
    pk, pv = torch.randn(G, kvh, P, D, generator=g), torch.randn(G, kvh, P, D, generator=g)
    pmask = torch.ones(G, P, dtype=torch.bool)
    group = torch.tensor([0, 0, 1])
    prefix = shared_prefix.SharedPrefix(pk, pv, pmask, group)
    q = torch.randn(3, kvh * rep, S, D, generator=g)
    sk, sv = torch.randn(3, kvh, S, D, generator=g), torch.randn(3, kvh, S, D, generator=g)
    sk._deltalens_prefix = prefix
    ours, _ = shared_prefix.shared_prefix_attention(_Module(), q, sk, sv, None, scaling=0.5)
    k = torch.cat([pk[group], sk], -2).repeat_interleave(rep, 1)
    v = torch.cat([pv[group], sv], -2).repeat_interleave(rep, 1)
    causal = torch.ones(S, P + S, dtype=torch.bool).tril_(P)  # query i sees the prompt and own tokens <= i
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=0.5).transpose(1, 2)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    bidirectional = F.scaled_dot_product_attention(q, k, v, scale=0.5).transpose(1, 2)
    assert not torch.allclose(ours, bidirectional)  # the mask made a difference


def test_without_a_shared_prompt_it_is_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 6, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    ours, _ = shared_prefix.shared_prefix_attention(_Module(), q, k, v, None, scaling=0.3)
    ref, _ = sdpa_attention_forward(_Module(), q, k, v, None, scaling=0.3)
    assert torch.equal(ours, ref)


@pytest.fixture(scope="module")
def tiny():
    from deltalens.io.models import load_model
    from deltalens.tasks import get_task

    model, tok = load_model(tiny_spec())
    return model, tok, [p.prompt for p in get_task("arith").test(10)]


@pytest.mark.parametrize("params", [SamplingParams(n=3, temperature=0.0, max_new_tokens=40),
                                    SamplingParams(n=4, temperature=1.0, max_new_tokens=40, seed=3)],
                         ids=["greedy", "sampled"])
def test_generation_same_as_with_copies(tiny, monkeypatch, params):
    model, tok, prompts = tiny
    taken = []
    real = shared_prefix._prefix_part
    monkeypatch.setattr(shared_prefix, "_prefix_part", lambda *a: (taken.append(1), real(*a))[1])
    monkeypatch.setattr(hf_mod, "SEGMENT", 8)  # rows end in different segments and leave the batch
    # one batch each (the shared layout fits more rows in a budget, and batches are seeded by their number)
    shared = HFBackend(model, tok, batch_tokens=10**6).generate(prompts, params)
    assert taken, "the shared-prompt attention was not used"
    assert model.config._attn_implementation == "sdpa"  # restored after each batch
    copies = HFBackend(model, tok, batch_tokens=10**6, share_prompts=False).generate(prompts, params)
    assert shared == copies
    assert len({c for cs in shared for c in cs}) > 1


def test_bf16_inputs_at_least_as_accurate_as_sdpa():
    """bf16 keys and values: SDPA rounds the attention probabilities to bf16 before it multiplies the values,
    the split softmax keeps them fp32; against fp32 attention of the same (bf16-valued) inputs, ours is
    no further off than SDPA in bf16 (so completions may differ from the copied cache's at near-ties)."""
    g = torch.Generator().manual_seed(4)
    G, kvh, rep, P, S, D = 2, 2, 3, 40, 6, 32
    pk, pv = torch.randn(G, kvh, P, D, generator=g), torch.randn(G, kvh, P, D, generator=g)
    pk, pv = pk.bfloat16().float(), pv.bfloat16().float()  # the prefix holds bf16 values, exactly, in fp32
    pmask = torch.ones(G, P, dtype=torch.bool)
    group = torch.tensor([0, 0, 0, 1, 1])
    prefix = shared_prefix.SharedPrefix(pk, pv, pmask, group)
    q = torch.randn(5, kvh * rep, 1, D, generator=g).mul(3).bfloat16()
    sk, sv = torch.randn(5, kvh, S, D, generator=g).bfloat16(), torch.randn(5, kvh, S, D, generator=g).bfloat16()
    smask = torch.ones(5, S, dtype=torch.bool)
    sk._deltalens_prefix = prefix
    ours, _ = shared_prefix.shared_prefix_attention(_Module(), q, sk, sv, None, scaling=D ** -0.5)
    exact = _reference(q.float(), pk, pv, pmask, group, sk.float(), sv.float(), smask, D ** -0.5)
    sdpa = _reference(q, pk.bfloat16(), pv.bfloat16(), pmask, group, sk, sv, smask, D ** -0.5)
    assert ours.dtype == torch.bfloat16
    err_ours, err_sdpa = (ours.float() - exact).abs().max(), (sdpa.float() - exact).abs().max()
    assert err_ours <= err_sdpa and err_ours <= 2 ** -8 * exact.abs().max()


def test_layers_not_ours_keep_the_copies():
    from transformers import DynamicCache

    model, _ = small_llama()
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    model(input_ids=ids, use_cache=True, **{kv_cache.cache_name(): cache})
    before = [layer.keys.clone() for layer in cache.layers]
    assert not kv_cache.share_prefix(cache, torch.tensor([0, 0, 1]), torch.ones(2, 3, dtype=torch.bool))
    assert all(torch.equal(layer.keys, b) for layer, b in zip(cache.layers, before))


def test_shared_cache_counts_the_prompt_and_follows_rows():
    layer = kv_cache._growing_layer_class()(reserve=2)
    g = torch.Generator().manual_seed(2)
    layer.update(torch.randn(2, 1, 5, 4, generator=g), torch.randn(2, 1, 5, 4, generator=g))
    layer.share(torch.tensor([0, 0, 1, 1, 1]), torch.ones(2, 5, dtype=torch.bool))
    assert layer.get_seq_length() == 5
    k, _ = layer.update(torch.randn(5, 1, 1, 4, generator=g), torch.randn(5, 1, 1, 4, generator=g))
    assert k.shape == (5, 1, 1, 4) and k._deltalens_prefix is layer.prefix and layer.get_seq_length() == 6
    layer.batch_select_indices(torch.tensor([1, 4]))
    assert layer.prefix.group.tolist() == [0, 1] and layer._k.shape[0] == 2
    with pytest.raises(NotImplementedError):
        layer.crop(1)
    layer.reset()
    assert layer.prefix is None and layer.get_seq_length() == 0


@pytest.mark.parametrize("n", [2, 8, 32])
def test_shared_batches_keep_the_kv_budget(n):
    """Every shared batch's cache (its prompts once, in fp32 = 2 bf16 tokens a token, and each row's own
    tokens) fits the token budget; with many samples a batch holds more rows than with copies."""
    from deltalens.generation.batching import length_batches

    lengths, new, budget = [148, 150, 149, 151, 160, 140, 155], 96, 23_300
    for batch in length_batches(lengths, n, new, budget, 1024, shared=True):
        prompts = {i for i, _ in batch}
        longest = max(lengths[i] for i in prompts)
        assert 2 * len(prompts) * longest + len(batch) * (new + 1) <= budget
    shared = next(length_batches(lengths, n, new, budget, 1024, shared=True))
    copies = next(length_batches(lengths, n, new, budget, 1024))
    assert (len(shared) > 2 * len(copies)) == (n == 32)


def test_layers_share_one_row_map_applied_once_per_selection():
    """share_prefix gives every layer the same row map; the cache's row selection (one indices tensor
    handed to each layer) maps the rows once."""
    model, _ = small_llama(layers=3)
    cache = kv_cache.new_cache(model.config, 4)
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    model(input_ids=ids, use_cache=True, **{kv_cache.cache_name(): cache})
    assert kv_cache.share_prefix(cache, torch.tensor([0, 0, 1, 1, 1]), torch.ones(2, 3, dtype=torch.bool))
    maps = {id(layer.prefix.rows) for layer in cache.layers}
    assert len(maps) == 1
    cache.batch_select_indices(torch.tensor([1, 2, 4]))
    assert cache.layers[0].prefix.group.tolist() == [0, 1, 1]
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert cache.layers[2].prefix.group.tolist() == [0, 1]
