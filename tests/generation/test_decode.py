"""`generation.decode`: our decoding loop computes the token ids transformers' `generate` computes for our
arguments (greedy and sampled, top-p, left padding, a cache filled before, rows ending early), on the tiny
checkpoint and small random Llama (bf16), Gemma 3 (a sliding-window layer) and Qwen2 models, through
`HFBackend` and ES population batching; a model whose generation_config adds logits processors is handed
to `generate`."""

from __future__ import annotations

import pytest
import torch
from support import member_completions, small_gemma3, small_llama, small_qwen2, tiny_spec

from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation import decode as decode_mod
from deltalens.generation.kv_cache import cache_name, new_cache
from deltalens.generation.sampling import sampling_kwargs

MODELS = {
    "tiny": lambda: __import__("deltalens.io.models", fromlist=["load_model"]).load_model(tiny_spec()),
    "llama-bf16": lambda: small_llama(dtype=torch.bfloat16, hidden=64, layers=2, heads=4, kv_heads=2,
                                      intermediate=128),
    "gemma3-sliding": lambda: small_gemma3(sliding=True),
    "qwen2": small_qwen2,
}
PROMPTS = ["12+7=", "3+44=", "5+5=", "100+23=", "7+8=", "61+2="]


@pytest.fixture(scope="module", params=list(MODELS))
def model_tok(request):
    return MODELS[request.param]()


def force_generate(monkeypatch):
    """Every segment through transformers' `generate` (the path before `generation.decode`)."""
    monkeypatch.setattr(decode_mod, "generate_settings", lambda model: ["forced by the test"])


@pytest.mark.parametrize("params", [
    SamplingParams(n=1, temperature=0.0, max_new_tokens=40),
    SamplingParams(n=3, temperature=0.0, max_new_tokens=40),
    SamplingParams(n=3, temperature=1.0, max_new_tokens=40, seed=5),
    SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=24, seed=2),
    SamplingParams(n=1, temperature=1.0, max_new_tokens=24, seed=3)],
    ids=["greedy-n1", "greedy-n3-shared", "sampled-n3-shared", "top-p", "sampled-n1"])
def test_hf_backend_same_ids_as_generate(model_tok, monkeypatch, params):
    model, tok = model_tok
    be = HFBackend(model, tok, batch_tokens=300)  # several batches; rows leave between segments
    ours = be.generate_ids(be.encode(PROMPTS), params)
    force_generate(monkeypatch)
    assert be.generate_ids(be.encode(PROMPTS), params) == ours
    if params.temperature > 0:  # draws that differ between rows (a random model's greedy rows may all agree)
        assert len({tuple(r) for rows in ours for r in rows}) > 1


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_one_segment_from_a_filled_cache(model_tok, temperature):
    """Left padding, the cache holding all but each row's last 3 tokens, a segment of 12: the same
    sequences, and the cache left at the same length, as `generate`'s."""
    model, tok = model_tok
    from deltalens.generation.batching import left_pad

    ids, att = left_pad([tok.encode(p) for p in PROMPTS], tok.pad_token_id)
    out = {}
    for way in ("generate", "decode"):
        cache = new_cache(model.config, 16)
        with torch.no_grad():
            pos = (att[:, :-3].cumsum(-1) - 1).masked_fill(att[:, :-3] == 0, 0)
            model(input_ids=ids[:, :-3], attention_mask=att[:, :-3], position_ids=pos, use_cache=True,
                  **{cache_name(): cache})
        torch.manual_seed(11)
        if way == "generate":
            seqs = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=12, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, return_dict_in_generate=True,
                                  **{cache_name(): cache}, **sampling_kwargs(temperature)).sequences
        else:
            seqs = decode_mod.decode_segment(model, ids, att, cache, 12, pad_token_id=tok.pad_token_id,
                                             eos_token_id=tok.eos_token_id, temperature=temperature)
        out[way] = (seqs, cache.get_seq_length())
    assert torch.equal(out["decode"][0], out["generate"][0]) and out["decode"][1] == out["generate"][1]


@pytest.mark.parametrize("steps,temperature", [(1, 0.0), (1, 1.0), (30, 0.0), (30, 1.0)])
def test_a_segment_ends_when_every_row_has(steps, temperature):
    """With "=" as the end token every tiny row ends within a few tokens: the segment stops there (fewer than
    max_new_tokens columns, as `generate` returns), and a one-token segment is one token."""
    from deltalens.generation.batching import left_pad
    from deltalens.io.models import load_model
    from deltalens.tasks import get_task

    model, tok = load_model(tiny_spec())
    ids, att = left_pad([tok.encode(p.prompt) for p in get_task("arith").test(6)], tok.pad_token_id)
    eos = tok.encode("=", add_special_tokens=False)[-1]  # written by every row within a few tokens (its answer's first step)
    out = {}
    for way in ("generate", "decode"):
        torch.manual_seed(4)
        cache = new_cache(model.config, 16)
        if way == "generate":
            out[way] = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=steps,
                                      pad_token_id=tok.pad_token_id, eos_token_id=eos,
                                      return_dict_in_generate=True, **{cache_name(): cache},
                                      **sampling_kwargs(temperature)).sequences
        else:
            out[way] = decode_mod.decode_segment(model, ids, att, cache, steps, pad_token_id=tok.pad_token_id,
                                                 eos_token_id=eos, temperature=temperature)
    assert torch.equal(out["decode"], out["generate"])
    new = out["decode"].shape[1] - ids.shape[1]
    assert new == 1 if steps == 1 else 1 < new < steps
    assert steps == 1 or bool((out["decode"][:, ids.shape[1]:] == eos).any(1).all())


@pytest.mark.parametrize("shared,temperature", [(False, 0.0), (True, 0.0), (True, 0.8)])
def test_population_batching_same_as_generate(monkeypatch, shared, temperature):
    """ES members generated together (members retired between segments, the shared prefix or not): the same
    completions as with `generate` doing each segment."""
    from deltalens.io.models import load_model

    model, tok = load_model(tiny_spec())
    ours = member_completions(model, tok, monkeypatch, shared_prefix=shared, temperature=temperature)
    force_generate(monkeypatch)
    assert member_completions(model, tok, monkeypatch, shared_prefix=shared, temperature=temperature) == ours
    assert len({tuple(c) for c in ours}) > 1


def test_a_generation_config_with_processors_goes_to_generate(monkeypatch):
    """A repetition penalty in the model's generation_config is not ours to drop: `generate` applies it."""
    from deltalens.io.models import load_model

    model, tok = load_model(tiny_spec())
    be = HFBackend(model, tok)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=30)
    plain = be.generate(PROMPTS, params)
    model.generation_config.repetition_penalty = 5.0
    try:
        assert decode_mod.generate_settings(model) == ["repetition_penalty"]
        monkeypatch.setattr(decode_mod, "decode_segment", lambda *a, **k: pytest.fail("decode_segment used"))
        penalised = be.generate(PROMPTS, params)
    finally:
        model.generation_config.repetition_penalty = 1.0
    assert penalised != plain and decode_mod.generate_settings(model) == []


def test_settings_decode_does_not_reproduce_are_named():
    """Beams, assisted decoding, `use_cache` off, a model class's own generation hooks: each named, so
    `generate_or_decode` hands the model to `generate`; token ids, lengths and sampling settings (which our
    call overrides) are not."""
    from transformers import LlamaForCausalLM

    model, _ = small_llama()
    cfg = model.generation_config
    assert decode_mod.generate_settings(model) == []
    cfg.update(top_k=20, temperature=0.7, top_p=0.8, max_length=99, pad_token_id=5)  # overridden by our call
    assert decode_mod.generate_settings(model) == []
    cfg.update(num_beams=1, repetition_penalty=1.0, use_cache=True)  # the neutral values
    assert decode_mod.generate_settings(model) == []
    cfg.update(num_beams=3, prompt_lookup_num_tokens=4, use_cache=False, remove_invalid_values=True)
    assert decode_mod.generate_settings(model) == ["num_beams", "prompt_lookup_num_tokens", "remove_invalid_values",
                                                   "use_cache"]

    class Hooked(LlamaForCausalLM):
        def prepare_inputs_for_generation(self, *args, **kwargs):
            return super().prepare_inputs_for_generation(*args, **kwargs)

    assert decode_mod.generate_settings(Hooked(model.config)) == ["Hooked.prepare_inputs_for_generation"]


def test_beams_in_the_generation_config_go_to_generate(monkeypatch):
    from deltalens.io.models import load_model

    model, tok = load_model(tiny_spec())
    be = HFBackend(model, tok)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=20)
    ours = be.generate_ids(be.encode(PROMPTS[:2]), params)
    model.generation_config.num_beams = 3
    try:
        monkeypatch.setattr(decode_mod, "decode_segment", lambda *a, **k: pytest.fail("decode_segment used"))
        beams = be.generate_ids(be.encode(PROMPTS[:2]), params)
    finally:
        model.generation_config.num_beams = 1
    assert beams != ours  # beam search kept, not replaced by greedy decoding


def test_a_model_without_logits_to_keep_samples_as_one_with_it():
    """HFBackend's prefill of a prompt's samples (`hf.prefill_prompts`) and the decoding steps leave out
    `logits_to_keep` for a model whose forward does not take it (it raised TypeError in the prefill)."""
    from transformers import LlamaForCausalLM

    class NoKeep(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None,
                    return_dict=None, cache=None, past_key_values=None):  # cache: transformers >= 5's name
            kw = {cache_name(): cache if cache is not None else past_key_values}
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=use_cache, return_dict=return_dict, **kw)

    model, tok = small_llama()
    plain = NoKeep(model.config).eval()
    plain.load_state_dict(model.state_dict())
    assert not decode_mod.keeps_logits(NoKeep) and decode_mod.keeps_logits(type(model))
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=20, seed=4)
    ours = HFBackend(model, tok, batch_tokens=300).generate_ids(HFBackend(model, tok).encode(PROMPTS), params)
    be = HFBackend(plain, tok, batch_tokens=300)
    assert be.generate_ids(be.encode(PROMPTS), params) == ours
