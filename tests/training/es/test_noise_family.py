"""The noise-family seam (deltalens.training.es.noise): a new family is one class, registered here in the
test file only, and every ES path uses it: the sequential engine, population batching, vLLM's fused
weights (FusedES) and a whole `train_es` run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import assert_same_weights, final_weights, small_llama, tiny_spec, weights

from deltalens.errors import DeltalensError
from deltalens.training.es import noise
from deltalens.training.es.config import ESConfig
from deltalens.training.es.engine import ESEngine, new_timing
from deltalens.training.es.strategy import member_noise
from deltalens.training.es.train import train_es
from deltalens.training.run import make_task


@noise.register
class RademacherNoise(noise.NoiseFamily):
    """ε_i ∈ {-1, +1} with equal probability (mean 0, variance 1), seeded per block like the Gaussian."""

    name = "rademacher"

    def draw(self, iteration, k, block, out):
        out.bernoulli_(0.5, generator=self.generator(iteration, k, block))
        return out.mul_(2).sub_(1)


FAST = {"population": 4, "prompts_per_iteration": 8, "sigma": 0.01, "alpha": 0.005, "eval_every": 0,
        "checkpoint_every": 0, "max_new_tokens": 48, "antithetic": True}


def _engine(**kw) -> ESEngine:
    model, tok = small_llama()
    cfg = ESConfig(**{"max_new_tokens": 4, "prompts_per_iteration": 2, "population": 4, "noise": "rademacher",
                      "sigma": 0.01, **kw})
    return ESEngine(model, tok, make_task(cfg), cfg)


def test_registered_family_is_a_config_choice_and_unknown_names_list_it():
    assert "rademacher" in noise.FAMILIES and ESConfig(noise="rademacher").noise == "rademacher"
    with pytest.raises(DeltalensError, match="rademacher"):  # the refusal names every family
        ESConfig(noise="sparse")
    with pytest.raises(ValueError, match="already registered"):  # a name is taken once

        @noise.register
        class Other(noise.NoiseFamily):
            name = "full"


def test_engine_draws_the_family_and_restores_exactly():
    eng = _engine()
    name = "model.layers.0.mlp.up_proj.weight"
    before = weights(eng.model)
    eng.perturb(1, 1, new_timing())  # member 1 = +ε_1 (no antithetic pairs)
    delta = eng.model.state_dict()[name] - before[name]
    eps = eng.noise_of(1, 1, name)
    assert set(eps.unique().tolist()) == {-1.0, 1.0}
    torch.testing.assert_close(delta, eng.config.sigma * eps, rtol=0, atol=1e-8)
    eng.restore(1, 1, new_timing())
    assert_same_weights(before, weights(eng.model))
    # the update is Σ z_i ε_i of the family's noise
    z = [0.5, -1.0, 1.5, -1.0]
    eng.update(1, z)
    cfg = eng.config
    want = sum(zi * eng.noise_of(1, member_noise(i, False)[0], name) for i, zi in enumerate(z))
    torch.testing.assert_close(eng.model.state_dict()[name], before[name] + cfg.alpha / cfg.population * want,
                               rtol=0, atol=1e-7)


def test_population_rows_are_the_sequential_members():
    from deltalens.training.es.population import member_weights

    eng = _engine(antithetic=True)
    rows = member_weights(eng, 2, [0, 1, 3], new_timing())
    p = eng.model.model.layers[1].self_attn.q_proj.weight
    for g, m in enumerate([0, 1, 3]):
        eng.perturb(2, m, new_timing())
        assert torch.equal(rows[(p.data_ptr(), tuple(p.shape))][g], p)
        eng.restore(2, m, new_timing())


def test_fused_vllm_weights_follow_the_family():
    """FusedES (vLLM's fused layout) gets the family's name in the plan and draws the same noise."""
    from deltalens.generation.vllm_layout import fuse
    from deltalens.io.models import load_model, weights_checksum
    from deltalens.training.es.backends.vllm import FusedES, es_plan

    tiny_spec()
    model, tok = load_model("tiny")
    cfg = ESConfig(population=4, noise="rademacher", noise_threads=1, sigma=0.01, alpha=0.005)
    eng = ESEngine(model, tok, make_task(cfg), cfg)
    fused = fuse({k: v.clone() for k, v in model.state_dict().items()}, model.config)
    es = FusedES(fused, es_plan(eng))
    assert es.family.name == "rademacher"
    eng.perturb(1, 2, new_timing())
    es.perturb(1, 2)
    assert es.checksum() == weights_checksum(model)
    eng.restore(1, 2, new_timing())
    es.restore(1, 2)
    eng.update(1, [0.5, -1.0, 1.5, -1.0])
    es.update(1, [0.5, -1.0, 1.5, -1.0])
    assert es.checksum() == weights_checksum(model)


def test_train_es_with_the_family_moves_and_is_deterministic(tmp_path):
    from deltalens.io.models import load_model
    from deltalens.io.runs import RunDir

    torch.set_num_threads(1)
    cfg = ESConfig(model=tiny_spec(), iterations=2, noise="rademacher", **FAST)
    a = train_es(cfg, tmp_path / "a")
    rows = RunDir(a).metrics()
    assert [r["iteration"] for r in rows] == [1, 2]
    assert any(r["reward_std"] > 0 for r in rows) and any(r["update_rms"] > 0 for r in rows)
    base, _ = load_model(cfg.model)
    final = final_weights(a)
    assert any(not torch.equal(v, final[k]) for k, v in base.state_dict().items())  # the weights moved
    assert RunDir(a).config()["noise"] == "rademacher"
    b = train_es(cfg, tmp_path / "b")  # same seed: the same run, bit for bit
    assert [(r["rewards"], r["checksum"]) for r in RunDir(b).metrics()] == [(r["rewards"], r["checksum"]) for r in rows]
    assert_same_weights(final, final_weights(b))
    # and it is not the Gaussian run under another name
    c = train_es(dataclasses.replace(cfg, noise="full"), tmp_path / "c")
    assert RunDir(c).metrics()[-1]["checksum"] != rows[-1]["checksum"]


def test_a_family_that_takes_tensors_must_say_how_members_are_written_into_a_copy():
    """bf16 members are written into the compute copy (`shift_into`): a family that takes tensors whole and
    did not define it is refused, rather than leaving those tensors unperturbed in every member."""

    class Whole(noise.GaussianNoise):
        name = "whole-test"

        def bind(self, tensors):
            self.items = [t for t in tensors if t[2].dim() == 2]
            return {t[0] for t in self.items}

    fam = Whole(0, 2, 4)
    fam.shift_into(1, 0, 0.1, lambda p: p, {})  # nothing taken yet: nothing to write
    fam.bind([(0, "w", torch.zeros(2, 2), 0)])
    with pytest.raises(NotImplementedError, match="whole-test"):
        fam.shift_into(1, 0, 0.1, lambda p: p, {})
