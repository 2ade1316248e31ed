"""ES in the reference script's arithmetic: identical ε for same-shaped tensors, weight-dtype accumulation,
restore by subtraction (drift in bf16, next to none in fp32)."""

from __future__ import annotations

import torch
from support import small_llama, weights

from deltalens.tasks import get_task
from deltalens.training.es.config import ESConfig
from deltalens.training.es.engine import ESEngine, new_timing


def _engine(dtype=torch.float32, **kw):
    model, tok = small_llama(dtype=dtype)
    cfg = ESConfig(population=4, prompts_per_iteration=2, max_new_tokens=4, arithmetic="reference",
                   restore="subtract", dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype], **kw)
    return ESEngine(model, tok, get_task("arith"), cfg)


def test_same_shaped_tensors_get_the_same_noise():
    eng = _engine()
    before = weights(eng.model)
    eng.perturb(1, 0, new_timing())
    after = weights(eng.model)
    d = {k: after[k] - before[k] for k in before}
    q0, q1 = d["model.layers.0.self_attn.q_proj.weight"], d["model.layers.1.self_attn.q_proj.weight"]
    n0, n1 = d["model.layers.0.input_layernorm.weight"], d["model.layers.1.post_attention_layernorm.weight"]
    cos = torch.nn.functional.cosine_similarity
    assert cos(q0.flatten(), q1.flatten(), dim=0) > 0.999 and cos(n0, n1, dim=0) > 0.999
    # ours: independent noise per block, so no two tensors share it
    ours = ESEngine(*small_llama(), get_task("arith"), ESConfig(population=4, prompts_per_iteration=2))
    b = weights(ours.model)
    ours.perturb(1, 0, new_timing())
    a = weights(ours.model)
    g0 = a["model.layers.0.self_attn.q_proj.weight"] - b["model.layers.0.self_attn.q_proj.weight"]
    g1 = a["model.layers.1.self_attn.q_proj.weight"] - b["model.layers.1.self_attn.q_proj.weight"]
    assert abs(cos(g0.flatten(), g1.flatten(), dim=0)) < 0.1


def test_bf16_restore_by_subtraction_drifts_and_fp32_nearly_does_not():
    drift = {}
    for dtype in (torch.float32, torch.bfloat16):
        eng = _engine(dtype=dtype, sigma=1.5e-3)
        before = weights(eng.model)
        t = new_timing()
        for m in range(4):
            eng.perturb(1, m, t)
            eng.restore(1, m, t)
        after = weights(eng.model)
        norm = "model.layers.0.input_layernorm.weight"  # RMSNorm weights are ~1: one bf16 step is 7.8e-3 > σ
        drift[dtype] = ((after[norm].float() - before[norm].float()).abs().max().item(),
                        sum(int((after[k] != before[k]).sum()) for k in before) / sum(v.numel() for v in before.values()))
    assert drift[torch.float32][0] < 1e-6
    assert drift[torch.bfloat16][0] >= 3.9e-3 and drift[torch.bfloat16][1] > 0.1


def test_update_follows_the_reference_formula():
    eng = _engine()
    before = weights(eng.model)
    z = [1.0, -0.5, 0.25, -0.75]
    eng.update(3, z)
    after = weights(eng.model)
    name = "model.layers.0.mlp.up_proj.weight"
    p = before[name]
    want = torch.zeros_like(p)
    for i, zi in enumerate(z):
        want += eng.reference.noise(p, eng.reference.member_seed(3, i)) * zi
    assert torch.allclose(after[name] - p, eng.config.alpha * want / 4, atol=1e-7)
