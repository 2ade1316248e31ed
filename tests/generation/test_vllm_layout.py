"""vLLM parameter layout (fused q/k/v and gate/up, padded vocabulary, tied embeddings) and ES noise
applied through it: known answers, and bit-for-bit agreement with the HF path, on CPU (no vLLM)."""

from __future__ import annotations

import pytest
import torch
from support import small_gemma3

from deltalens.errors import DeltalensError
from deltalens.generation.vllm_layout import (
    arch,
    flat_range,
    fuse,
    hf_param_shapes,
    hf_to_vllm_name,
    hf_unique_names,
    unfuse,
    vllm_shapes,
    vllm_slices,
)


def tiny():
    from deltalens.io.models import load_model
    from deltalens.tiny import MODEL_DIR

    if not (MODEL_DIR / "config.json").exists():
        pytest.skip("bundled tiny model missing (python -m deltalens.tiny.build)")
    return load_model("tiny")


def qwen2(tied: bool, dtype=torch.float32):
    """A small random Qwen2 (GQA 6/2 heads, q/k/v biases), with its char tokenizer from the tiny build."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from deltalens.tiny.build import build_tokenizer

    torch.manual_seed(1)
    tok = build_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=tied,
                      max_position_embeddings=256, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # random (non-zero) biases, so a misplaced bias slice cannot pass unnoticed
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_()
    return model, tok


def llama_biased():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    cfg = LlamaConfig(vocab_size=70, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=16, attention_bias=True,
                      mlp_bias=True, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def gemma3():
    return small_gemma3()


def test_gemma3_slices_known_answers():
    model, _ = gemma3()  # hidden 32, 4 heads x 16 (q 64 rows), 1 kv head (16), intermediate 48
    s = vllm_slices(model.config)
    L = "model.layers.1."
    assert s[L + "self_attn.q_proj.weight"] == (L + "self_attn.qkv_proj.weight", 0, 0, 64)
    assert s[L + "self_attn.v_proj.weight"] == (L + "self_attn.qkv_proj.weight", 0, 80, 96)
    assert s[L + "mlp.up_proj.weight"] == (L + "mlp.gate_up_proj.weight", 0, 48, 96)
    assert s[L + "self_attn.q_norm.weight"] == (L + "self_attn.q_norm.weight", 0, 0, 16)  # head_dim, unfused
    assert s[L + "post_feedforward_layernorm.weight"] == (L + "post_feedforward_layernorm.weight", 0, 0, 32)
    assert s["lm_head.weight"] == ("model.embed_tokens.weight", 0, 0, model.config.vocab_size)
    v = vllm_shapes(model.config)
    assert v[L + "self_attn.o_proj.weight"] == (32, 64)
    assert len(v) == 2 + 2 * 10  # embed, norm; per layer (2) qkv, o, q/k norms, gate_up, down, 4 norms


def _shapes_of(model):
    return {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}


# ---------------------------------------------------------------------------------------------
# known answers


def test_hf_to_vllm_name_known_answers():
    assert hf_to_vllm_name("model.layers.3.self_attn.q_proj.weight") == ("model.layers.3.self_attn.qkv_proj.weight", "q")
    assert hf_to_vllm_name("model.layers.3.self_attn.k_proj.bias") == ("model.layers.3.self_attn.qkv_proj.bias", "k")
    assert hf_to_vllm_name("model.layers.0.self_attn.v_proj.weight") == ("model.layers.0.self_attn.qkv_proj.weight", "v")
    assert hf_to_vllm_name("model.layers.11.mlp.gate_proj.weight") == ("model.layers.11.mlp.gate_up_proj.weight", 0)
    assert hf_to_vllm_name("model.layers.11.mlp.up_proj.weight") == ("model.layers.11.mlp.gate_up_proj.weight", 1)
    for same in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.0.input_layernorm.weight", "model.norm.weight", "model.embed_tokens.weight",
                 "lm_head.weight"):
        assert hf_to_vllm_name(same) == (same, None)
    assert hf_to_vllm_name("lm_head.weight", tied=True) == ("model.embed_tokens.weight", None)


def test_tiny_slices_known_answers():
    model, _ = tiny()
    cfg = model.config  # hidden 128, 4 heads x 32, 2 kv heads (GQA), intermediate 352, vocab 99, untied
    s = vllm_slices(cfg)
    L = "model.layers.2."
    assert s[L + "self_attn.q_proj.weight"] == (L + "self_attn.qkv_proj.weight", 0, 0, 128)
    assert s[L + "self_attn.k_proj.weight"] == (L + "self_attn.qkv_proj.weight", 0, 128, 192)
    assert s[L + "self_attn.v_proj.weight"] == (L + "self_attn.qkv_proj.weight", 0, 192, 256)
    assert s[L + "mlp.gate_proj.weight"] == (L + "mlp.gate_up_proj.weight", 0, 0, 352)
    assert s[L + "mlp.up_proj.weight"] == (L + "mlp.gate_up_proj.weight", 0, 352, 704)
    assert s[L + "self_attn.o_proj.weight"] == (L + "self_attn.o_proj.weight", 0, 0, 128)
    assert s["model.embed_tokens.weight"] == ("model.embed_tokens.weight", 0, 0, 99)
    assert s["lm_head.weight"] == ("lm_head.weight", 0, 0, 99)
    v = vllm_shapes(cfg)
    assert v[L + "self_attn.qkv_proj.weight"] == (256, 128)
    assert v[L + "mlp.gate_up_proj.weight"] == (704, 128)
    assert v["model.embed_tokens.weight"] == (128, 128)  # 99 padded to a multiple of 64
    assert v["lm_head.weight"] == (128, 128)
    assert L + "self_attn.q_proj.weight" not in v
    assert len(v) == 2 + 1 + 4 * 6  # embed, lm_head, norm; per layer qkv, o, gate_up, down, 2 norms
    # flat ranges: k_proj is rows 128..192 of a (256, 128) tensor
    assert flat_range(L + "self_attn.k_proj.weight", cfg, (256, 128)) == (L + "self_attn.qkv_proj.weight",
                                                                          128 * 128, 64 * 128)
    with pytest.raises(DeltalensError, match="tensor_parallel_size=1"):
        flat_range(L + "self_attn.v_proj.weight", cfg, (128, 128))  # a TP=2 shard


def test_qwen2_slices_known_answers():
    model, _ = qwen2(tied=True)  # hidden 48, 6 heads x 8, 2 kv heads, intermediate 80
    s = vllm_slices(model.config)
    L = "model.layers.1."
    assert s[L + "self_attn.q_proj.bias"] == (L + "self_attn.qkv_proj.bias", 0, 0, 48)
    assert s[L + "self_attn.k_proj.bias"] == (L + "self_attn.qkv_proj.bias", 0, 48, 64)
    assert s[L + "self_attn.v_proj.bias"] == (L + "self_attn.qkv_proj.bias", 0, 64, 80)
    assert s[L + "self_attn.v_proj.weight"] == (L + "self_attn.qkv_proj.weight", 0, 64, 80)
    assert s["lm_head.weight"] == ("model.embed_tokens.weight", 0, 0, model.config.vocab_size)
    v = vllm_shapes(model.config)
    assert v[L + "self_attn.qkv_proj.bias"] == (80,)
    assert "lm_head.weight" not in v  # tied: one tensor
    assert L + "self_attn.o_proj.bias" not in v  # Qwen2: no o_proj bias


@pytest.mark.parametrize("which", ["tiny", "qwen2", "qwen2-untied", "llama-biased", "gemma3"])
def test_hf_param_shapes_match_transformers(which):
    model = {"tiny": lambda: tiny()[0], "qwen2": lambda: qwen2(True)[0], "qwen2-untied": lambda: qwen2(False)[0],
             "llama-biased": llama_biased, "gemma3": lambda: gemma3()[0]}[which]()
    want = _shapes_of(model)
    got = hf_param_shapes(model.config)
    assert list(got.items()) == list(want.items())  # names, shapes and module order
    assert hf_unique_names(model.config) == [n for n, _ in model.named_parameters()]
    assert hf_unique_names(model.config.to_dict()) == hf_unique_names(model.config)  # a dict config works too


def test_unsupported_model_type():
    with pytest.raises(DeltalensError, match="supports llama, qwen2, gemma3_text"):
        arch({"model_type": "gpt2"})


# ---------------------------------------------------------------------------------------------
# fuse / unfuse


@pytest.mark.parametrize("which", ["tiny", "qwen2", "qwen2-untied", "llama-biased", "qwen2-bf16", "gemma3"])
def test_fuse_known_answer_and_roundtrip(which):
    model = {"tiny": lambda: tiny()[0], "qwen2": lambda: qwen2(True)[0], "qwen2-untied": lambda: qwen2(False)[0],
             "llama-biased": llama_biased, "qwen2-bf16": lambda: qwen2(True, torch.bfloat16)[0],
             "gemma3": lambda: gemma3()[0]}[which]()
    cfg = model.config
    a = arch(cfg)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    fused = fuse(sd, cfg)
    assert {k: tuple(v.shape) for k, v in fused.items()} == vllm_shapes(cfg)
    L = "model.layers.1."
    exp_qkv = torch.cat([sd[L + f"self_attn.{p}_proj.weight"] for p in "qkv"], 0)
    assert torch.equal(fused[L + "self_attn.qkv_proj.weight"], exp_qkv)
    exp_gu = torch.cat([sd[L + "mlp.gate_proj.weight"], sd[L + "mlp.up_proj.weight"]], 0)
    assert torch.equal(fused[L + "mlp.gate_up_proj.weight"], exp_gu)
    if a.qkv_bias:
        exp_b = torch.cat([sd[L + f"self_attn.{p}_proj.bias"] for p in "qkv"], 0)
        assert torch.equal(fused[L + "self_attn.qkv_proj.bias"], exp_b)
    emb = fused["model.embed_tokens.weight"]
    assert torch.equal(emb[: a.vocab], sd["model.embed_tokens.weight"])
    assert not emb[a.vocab:].any()  # padded rows are zero
    assert ("lm_head.weight" in fused) == (not a.tied)
    back = unfuse(fused, cfg)
    assert list(back) == list(sd)  # same keys, same order (lm_head included when tied)
    for k, t in sd.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    assert "lm_head.weight" not in unfuse(fused, cfg, include_tied=False) or not a.tied


def test_fuse_rejects_mismatch():
    model, _ = tiny()
    sd = dict(model.state_dict())
    sd.pop("model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(DeltalensError, match="missing"):
        fuse(sd, model.config)
    sd = dict(model.state_dict())
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 128)
    with pytest.raises(DeltalensError, match="does not fit"):
        fuse(sd, model.config)


# ---------------------------------------------------------------------------------------------
# ES noise through the fused layout, bit for bit


def _engine(model, tok, **overrides):
    from deltalens.tasks import get_task
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.engine import ESEngine

    cfg = ESConfig(**{"population": 4, "prompts_per_iteration": 4, "sigma": 0.01, "alpha": 0.005,
                      "eval_every": 0, "noise_threads": 1, **overrides})
    return ESEngine(model, tok, get_task("arith"), cfg)


def _fused_noise(engine, iteration, k, config) -> dict[str, torch.Tensor]:
    """ε_k of every trained HF tensor placed into zero fused tensors through `vllm_slices`."""
    shapes = vllm_shapes(config)
    out = {v: torch.zeros(s) for v, s in shapes.items()}
    for _, name, _ in engine.params:
        vname, dim, start, stop = vllm_slices(config)[name]
        out[vname].narrow(dim, start, stop - start).copy_(engine.noise_of(iteration, k, name))
    return out


@pytest.mark.parametrize("which", ["tiny", "qwen2", "gemma3"])
def test_fused_noise_equals_fused_hf_noise(which):
    """fuse(hf + σε) == fuse(hf) + σ·fused-ε, bit for bit, ε built through the slice mapping."""
    model, tok = {"tiny": tiny, "qwen2": lambda: qwen2(tied=True), "gemma3": gemma3}[which]()
    cfg = model.config
    engine = _engine(model, tok)
    base = fuse({k: v.clone() for k, v in model.state_dict().items()}, cfg)
    timing = {"noise_s": 0.0, "perturb_restore_s": 0.0}
    engine.perturb(1, 2, timing)
    perturbed = fuse({k: v.clone() for k, v in model.state_dict().items()}, cfg)
    eps = _fused_noise(engine, 1, 2, cfg)
    for v in base:
        want = base[v].clone().add_(eps[v], alpha=engine.config.sigma)
        assert torch.equal(perturbed[v], want), v
    engine.restore(1, 2, timing)
    assert all(torch.equal(fuse(dict(model.state_dict()), cfg)[v], base[v]) for v in base)


def _check_fused_es(model, tok, iterations=2, **overrides):
    """FusedES on fused tensors vs ESEngine on the HF model: perturb, restore and update agree bit for bit
    (the fused state equals fuse(HF state) after every step), and so do the checksums."""
    from deltalens.training.es.backends.vllm import FusedES, es_plan
    from deltalens.training.es.engine import new_timing, weights_checksum
    from deltalens.training.es.strategy import fitness_shaping

    cfg = model.config
    engine = _engine(model, tok, **overrides)
    fused = fuse({k: v.clone() for k, v in model.state_dict().items()}, cfg)
    es = FusedES(fused, es_plan(engine))
    assert es.checksum() == weights_checksum(model)

    def same(tag):
        want = fuse({k: v.clone() for k, v in model.state_dict().items()}, cfg)
        for v in want:
            assert torch.equal(fused[v], want[v]), f"{tag}: {v}"

    gen = torch.Generator().manual_seed(0)
    for it in range(1, iterations + 1):
        for m in range(engine.config.population):
            engine.perturb(it, m, new_timing())
            es.perturb(it, m)
            same(f"perturb it={it} m={m}")
            engine.restore(it, m, new_timing())
            es.restore(it, m)
            same(f"restore it={it} m={m}")
        rewards = torch.rand(engine.config.population, generator=gen).tolist()
        z = fitness_shaping(rewards, "zscore")
        r_hf = engine.update(it, z)
        r_v = es.update(it, z)
        same(f"update it={it}")
        assert r_v["update_rms"] == pytest.approx(r_hf["update_rms"], rel=1e-12)
        assert es.checksum() == weights_checksum(model)
    # export gives the HF state dict back
    sd = es.export()
    assert all(torch.equal(sd[n], p) for n, p in model.named_parameters())
    es.close()
    engine.close()


def test_fused_es_matches_hf_tiny():
    model, tok = tiny()
    _check_fused_es(model, tok)


def test_fused_es_matches_hf_qwen2_tied_antithetic_filter():
    model, tok = qwen2(tied=True)
    _check_fused_es(model, tok, antithetic=True, params=("*", "!*layernorm*"))


def test_fused_es_matches_hf_qwen2_bf16_subtract():
    model, tok = qwen2(tied=False, dtype=torch.bfloat16)
    _check_fused_es(model, tok, dtype="bf16", restore="subtract", iterations=1)


def test_fused_es_matches_hf_gemma3():
    model, tok = gemma3()
    _check_fused_es(model, tok, iterations=1)


def test_fused_es_chunked_blocks(monkeypatch):
    """Tensors larger than one noise block (CHUNK) are split into blocks exactly as ESEngine splits them."""
    import deltalens.training.es.engine as es_mod

    monkeypatch.setattr(es_mod, "CHUNK", 1000)  # the embedding (99x128) and MLPs become several blocks
    model, tok = tiny()
    _check_fused_es(model, tok, iterations=1, params=("model.embed_tokens.weight", "*.mlp.*", "*.k_proj.*"))


def test_fused_es_threads_same_result():
    """A thread pool over blocks gives the same weights as one thread."""
    from deltalens.training.es.backends.vllm import FusedES, es_plan

    model, tok = tiny()
    engine = _engine(model, tok)
    plan = es_plan(engine)
    sums = []
    for threads in (1, 3):
        fused = fuse(dict(model.state_dict()), model.config)
        es = FusedES(fused, plan, threads=threads)
        if threads > 1:  # force the pool even below PARALLEL_MIN
            from concurrent.futures import ThreadPoolExecutor

            es._pool = ThreadPoolExecutor(threads)
        es.perturb(1, 0)
        es.update(1, [1.0, -1.0, 0.5, -0.5])
        sums.append(es.checksum())
        es.close()
    assert sums[0] == sums[1]


def test_fused_es_rejects_wrong_layout():
    from deltalens.training.es.backends.vllm import FusedES, es_plan

    model, tok = tiny()
    engine = _engine(model, tok)
    fused = fuse(dict(model.state_dict()), model.config)
    bad = dict(fused)
    bad["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(128, 128)  # a TP=2 shard
    with pytest.raises(DeltalensError, match="tensor_parallel_size=1"):
        FusedES(bad, es_plan(engine))
    bad = dict(fused)
    bad.pop("model.layers.0.mlp.gate_up_proj.weight")
    with pytest.raises(DeltalensError, match="no parameter model.layers.0.mlp.gate_up_proj.weight"):
        FusedES(bad, es_plan(engine))
    with pytest.raises(DeltalensError, match="same --dtype"):
        FusedES({k: v.to(torch.bfloat16) for k, v in fused.items()}, es_plan(engine))
