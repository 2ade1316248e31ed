"""The wheel-assembled named models for real (docs/models.md): each loads under its name, the chat template
is chosen per model (Qwen2.5: ChatML; Gemma 3 base: none, so plain prompts), deltalens' own GGUF reader
gives the tensors transformers loads (the base of every diff is the base training starts from), and Gemma's
norm convention is what docs/models.md states. Each test skips unless `deltalens models fetch NAME` has put
the model on this machine (tests never download it)."""

from __future__ import annotations

import pytest
import torch

from deltalens.io import wheel_models as wm


def need(name: str):
    path = wm.cached_path(name)
    if not path.is_file():
        pytest.skip(f"{name} is not assembled here (deltalens models fetch {name})")
    return path


def test_qwen05_loads_by_name_chats_and_answers_and_its_gguf_reader_agrees():
    path = need("qwen2.5-0.5b")
    from deltalens.generation.prompts import uses_chat
    from deltalens.io.models import load_model
    from deltalens.io.spec import resolve
    from deltalens.io.tensors import open_tensors

    ref = resolve("qwen2.5-0.5b")
    assert ref.kind == "gguf" and ref.path == path
    model, tok = load_model("qwen2.5-0.5b")
    assert type(model).__name__ == "Qwen2ForCausalLM" and not model.config.tie_word_embeddings
    assert uses_chat(tok, "auto")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25? Reply with the number only."}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == "42"
    sd = model.state_dict()
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.3.self_attn.q_proj.weight",
             "model.layers.3.self_attn.q_proj.bias", "model.layers.3.self_attn.k_proj.weight",
             "model.layers.3.input_layernorm.weight", "model.norm.weight", "model.layers.23.mlp.down_proj.weight"]
    with open_tensors("qwen2.5-0.5b") as src:
        assert set(src.names()) == set(sd)
        for n in names:
            assert torch.equal(src.get(n).float(), sd[n].float()), n


def test_gemma_base_gets_plain_prompts_and_its_norms_are_stored_as_one_plus_w():
    path = need("gemma3-270m")
    import gguf

    from deltalens.generation.prompts import uses_chat
    from deltalens.io.models import load_model

    model, tok = load_model("gemma3-270m")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert not uses_chat(tok, "auto") and not wm.MODELS["gemma3-270m"].chat
    # a plain prompt starts with BOS, as the GGUF's tokenizer.ggml.add_bos_token says (deltalens.io.models.gguf_bos)
    from deltalens.generation.prompts import encode_prompts

    assert encode_prompts(tok, ["Q: What is 1 + 2?\nA:"])[0][0] == tok.bos_token_id == 2
    raw = {t.name: torch.tensor(t.data.copy()) for t in gguf.GGUFReader(path).tensors
           if t.name in ("blk.0.attn_norm.weight", "output_norm.weight")}
    sd = model.state_dict()
    # llama.cpp stores the scale that acts, 1 + w; transformers holds w (Gemma's RMSNorm computes x * (1 + w))
    assert torch.allclose(raw["blk.0.attn_norm.weight"].float(), sd["model.layers.0.input_layernorm.weight"] + 1)
    assert torch.allclose(raw["output_norm.weight"].float(), sd["model.norm.weight"] + 1)
    # deltalens' own reader (every diff's base) gives transformers' tensors, names and values, norms as w
    from deltalens.io.tensors import open_tensors

    with open_tensors("gemma3-270m") as src:
        names = set(src.names())
        assert names == set(sd) - {"lm_head.weight"}  # tied: the GGUF has no output.weight
        for n in sorted(names):
            assert torch.equal(src.get(n).float(), sd[n].float()), n
