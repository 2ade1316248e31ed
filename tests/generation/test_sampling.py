"""The inverse-CDF draw (`deltalens.generation.sampling`): known distributions reproduced (frequencies within
5 standard errors over 400k draws, vocabularies across several blocks and not a multiple of the block),
entries of probability 0 never drawn (masked, padded, top-p cut), seeded generation reproducible, greedy
decoding untouched, and the same distribution as transformers' own `torch.multinomial` sampling on a model."""

from __future__ import annotations

import math

import pytest
import torch
from support import small_llama

from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation.sampling import BLOCK, InverseCDFSampler, inverse_cdf_draw, sampling_kwargs


def within_5se(freq: torch.Tensor, probs: torch.Tensor, n: int) -> bool:
    """Observed frequencies (of n draws) within 5 standard errors of `probs` (fp64): entries expected >= 25
    times one by one, the rarer ones pooled (a normal bound needs counts)."""
    common = probs * n >= 25
    f = torch.cat([freq[common], freq[~common].sum(0, keepdim=True)])
    q = torch.cat([probs[common], probs[~common].sum(0, keepdim=True)])
    return bool(((f - q).abs() <= 5 * (q * (1 - q) / n).sqrt() + 1e-12).all())


@pytest.mark.parametrize("vocab", [3, BLOCK, 3 * BLOCK + 17])
def test_draws_follow_the_distribution(vocab):
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(vocab, generator=g) ** 4
    probs[torch.randperm(vocab, generator=g)[: vocab // 3]] = 0  # a third of the entries impossible
    probs[-1] = 0.2  # the very last entry reachable
    probs /= probs.sum()
    n = 400_000
    torch.manual_seed(0)
    ids = inverse_cdf_draw(probs.log().expand(n, vocab))
    freq = torch.bincount(ids, minlength=vocab).double() / n
    assert freq.shape[0] == vocab  # nothing past the vocabulary (the padding of the last block)
    assert float(freq[probs == 0].sum()) == 0.0
    assert within_5se(freq, probs.double(), n)


@pytest.mark.parametrize("vocab", [5, 2 * BLOCK + 40])
def test_the_processor_applies_the_temperature_in_place(vocab):
    """What `generate` runs without top-p: softmax(scores / T) drawn inside the fp32 scores it is given
    (no [rows, V] tensor of its own), the partial last block included."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=g) * 2
    logits[-1] = logits.max() + 0.5  # the last entry (in the partial block) the likeliest
    probs = (logits.double() / 0.7).softmax(-1)
    n = 200_000
    scores = logits.expand(n, vocab).contiguous()
    torch.manual_seed(0)
    out = InverseCDFSampler(0.7)(None, scores)
    assert out.data_ptr() == scores.data_ptr()  # written in place
    assert bool(((out == 0).sum(-1) == 1).all()) and bool((out.amax(-1) == 0).all())
    freq = torch.bincount(out.argmax(-1), minlength=vocab).double() / n
    assert within_5se(freq, probs, n)
    assert len(sampling_kwargs(0.7)["logits_processor"]) == 1  # the temperature is inside the draw


def test_one_allowed_token_is_always_drawn():
    scores = torch.full((5, 2 * BLOCK + 3), float("-inf"))
    want = torch.tensor([0, BLOCK - 1, BLOCK, 2 * BLOCK + 2, 7])
    scores[torch.arange(5), want] = 1.0
    assert torch.equal(inverse_cdf_draw(scores), want)


def test_kwargs_greedy_untouched_and_top_p_masks():
    assert sampling_kwargs(0.0) == {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    kw = sampling_kwargs(0.5, top_p=0.9)
    assert kw["do_sample"] is False and len(kw["logits_processor"]) == 3
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(20_000, 4)
    torch.manual_seed(1)
    out = kw["logits_processor"](None, scores.clone())
    drawn = out.argmax(-1)
    assert bool(((out == 0).sum(-1) == 1).all())  # one token left per row, the draw
    # T = 0.5 squares the odds (0.685, 0.247, 0.062, 0.007 after it); top-p 0.9 keeps the first two
    assert set(drawn.tolist()) == {0, 1}
    share = float((drawn == 0).double().mean())
    assert abs(share - 0.25 / 0.34) < 5 * math.sqrt(0.2 / 20_000)


def test_generation_seeded_and_distributed_as_transformers_samples():
    model, tok = small_llama(seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # a random model's logits are near uniform: spread them out
    prompts = ["12+7=", "3+44=", "50-8="]
    be = HFBackend(model, tok)
    params = SamplingParams(n=20, temperature=1.0, max_new_tokens=8, seed=3)
    ours = be.generate(prompts, params)
    assert be.generate(prompts, params) == ours
    assert be.generate(prompts, SamplingParams(n=20, temperature=1.0, max_new_tokens=8, seed=4)) != ours
    # the first token's distribution against transformers' multinomial sampling of the same logits,
    # 2,000 draws each way: a two-sample test for each of the 5 likeliest tokens
    n = 2000
    for p in prompts:
        x = tok(p, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            probs = model(x).logits[0, -1].float().softmax(-1)
            torch.manual_seed(5)
            ref = model.generate(x.expand(n, -1), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=1, pad_token_id=tok.pad_token_id)[:, -1]
            torch.manual_seed(6)
            got = model.generate(x.expand(n, -1), max_new_tokens=1, pad_token_id=tok.pad_token_id,
                                 **sampling_kwargs(1.0))[:, -1]
        assert float(probs.max()) < 0.5  # several likely tokens: the comparison has power
        for t in probs.topk(5).indices.tolist():
            a, b = float((ref == t).double().mean()), float((got == t).double().mean())
            se = math.sqrt(2 * float(probs[t]) * (1 - float(probs[t])) / n)
            assert abs(a - b) <= 5 * se, (p, t, a, b)
