"""The one perturb/restore/update seam (`deltalens.training.es.noise.ReplicaES`): `ESEngine` and `FusedES`
run the same steps, and any layout of the weights (here: plain tensors holding a copy of the model) that
hands it a `Perturber` over the engine's blocks gets the engine's weights bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from support import assert_same_weights, small_llama, weights

from deltalens.generation.vllm_layout import fuse
from deltalens.training.es.backends.vllm import FusedES, es_plan
from deltalens.training.es.config import ESConfig
from deltalens.training.es.engine import ESEngine, new_timing
from deltalens.training.es.noise import Perturber, ReplicaES
from deltalens.training.es.strategy import fitness_shaping, member_noise
from deltalens.training.run import make_task


def _engine(**kw) -> ESEngine:
    model, tok = small_llama(tied=True)
    cfg = ESConfig(**{"population": 4, "prompts_per_iteration": 2, "sigma": 0.01, "alpha": 0.005, "eval_every": 0,
                      "noise_threads": 1, **kw})
    return ESEngine(model, tok, make_task(cfg), cfg)


def test_engine_and_fused_weights_share_the_seam():
    eng = _engine()
    fused = FusedES(fuse(dict(eng.model.state_dict()), eng.model.config), es_plan(eng))
    assert type(eng.es) is ReplicaES and type(fused.es) is ReplicaES
    assert eng.es.perturber is eng.perturber and fused.es.perturber is fused.perturber
    assert eng.es.n_trained == eng.n_trained == fused.es.n_trained
    fused.close()
    eng.close()


@pytest.mark.parametrize("kw", [{}, {"antithetic": True, "restore": "subtract", "params": ("*.mlp.*", "*norm*")},
                                {"noise": "lowrank", "rank": 2}])
def test_a_new_layout_is_a_perturber_and_a_replica(kw):
    """Plain tensors holding a copy of the trained weights, cut into the engine's blocks (same global
    block ids): `ReplicaES` over them gives the engine's perturbed, restored and updated weights exactly
    (dense noise; a family that takes tensors whole binds them through its own `bind`)."""
    eng = _engine(**kw)
    copies = [p.detach().clone() for _, _, p in eng.params]
    if eng.family.items:  # low rank: the copy binds the 2-D tensors to its own family instance
        from deltalens.training.es.noise import make_family

        family = make_family(eng.config.noise, eng.config.seed, eng.n_noise, eng.n_blocks, config=eng.config)
        taken = family.bind([(j, name, copies[j], eng.first_block[j]) for j, (_, name, _) in enumerate(eng.params)])
    else:
        family, taken = eng.family, set()

    def view(j, flat):  # the same elements of the copy as `flat` is of the model's tensor j
        start = (flat.data_ptr() - eng.params[j][2].data_ptr()) // flat.element_size()
        return copies[j].view(-1)[start:start + flat.numel()]

    blocks = [(j, view(j, flat), b) for j, flat, b in eng.blocks if j not in taken]
    cfg = eng.config
    rep = ReplicaES(Perturber(family, blocks), copies, sigma=cfg.sigma, alpha=cfg.alpha,
                    population=cfg.population, antithetic=cfg.antithetic, restore=cfg.restore)

    def same():
        for (_, name, p), c in zip(eng.params, copies):
            assert torch.equal(p, c), name

    gen = torch.Generator().manual_seed(0)
    for it in (1, 2):
        for m in range(cfg.population):
            eng.perturb(it, m, new_timing())
            rep.perturb(it, m, new_timing())
            same()
            eng.restore(it, m, new_timing())
            rep.restore(it, m, new_timing())
            same()
        z = fitness_shaping(torch.rand(cfg.population, generator=gen).tolist(), "zscore")
        r_eng, r_rep = eng.update(it, z), rep.update(it, z)
        same()
        assert r_rep["update_rms"] == r_eng["update_rms"] > 0
    eng.close()
    rep.close()


def test_shift_of_is_the_members_noise_and_sign():
    eng = _engine(antithetic=True)
    for m in range(eng.config.population):
        k, sign = member_noise(m, True)
        assert eng.es.shift_of(m) == (k, sign * eng.config.sigma)
    eng.close()


def test_a_dropped_base_is_taken_again_from_the_new_weights():
    """What a Ray replica does after loading the driver's weights (`engine._base = None`): the next
    perturbation copies the new weights, so restore gives them back exactly."""
    eng = _engine()
    eng.perturb(1, 0, new_timing())
    eng.restore(1, 0, new_timing())
    assert eng._base is eng.es.base is not None
    with torch.no_grad():
        for _, _, p in eng.params:
            p.add_(0.25)  # new weights loaded in place
    new = weights(eng.model)
    eng._base = None
    assert eng.es.base is None
    eng.perturb(1, 1, new_timing())
    eng.restore(1, 1, new_timing())
    assert_same_weights(weights(eng.model), new)
    out = eng.update(1, [1.0, -1.0, 0.5, -0.5])
    assert set(out) == {"update_s", "update_noise_s", "update_rms"} and math.isfinite(out["update_rms"])
    eng.close()
