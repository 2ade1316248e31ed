"""ES trainer: noise seeding, exact restore, tied weights, update formula, determinism, resume, CLI."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from support import assert_same_weights, final_weights, run_cli, small_llama, tiny_spec, weights

from deltalens.errors import DeltalensError
from deltalens.training.es.config import ESConfig
from deltalens.training.es.engine import ESEngine, new_timing, select_params
from deltalens.training.es.strategy import (
    _mix32,
    fitness_shaping,
    iteration_problems,
    member_noise,
    noise_seed,
)
from deltalens.training.es.train import train_es


def _small_model(tied: bool = False, dtype=torch.float32):
    return small_llama(tied=tied, dtype=dtype)



# settings small enough for a ~1 s iteration on one CPU core; sigma large enough for reward variance
FAST = {"population": 4, "prompts_per_iteration": 8, "sigma": 0.01, "alpha": 0.005, "eval_every": 0,
        "eval_limit": 8, "checkpoint_every": 2, "max_new_tokens": 48}


def _engine(tied=False, dtype=torch.float32, **kw):
    from deltalens.tasks import get_task

    model, tok = _small_model(tied, dtype)
    cfg = ESConfig(max_new_tokens=4, prompts_per_iteration=2, population=4,
                   dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype], **kw)
    return ESEngine(model, tok, get_task("arith"), cfg)


# ---------------------------------------------------------------------------- config


def test_config_validation_says_what_to_change():
    with pytest.raises(DeltalensError, match="--population"):
        ESConfig(population=1)
    with pytest.raises(DeltalensError, match="even"):
        ESConfig(population=5, antithetic=True)
    with pytest.raises(DeltalensError, match="--sigma"):
        ESConfig(sigma=0)
    with pytest.raises(DeltalensError, match="fitness"):
        ESConfig(fitness="ranks")
    with pytest.raises(DeltalensError, match="unknown ES preset"):
        ESConfig.preset("huge")
    cfg = ESConfig.preset("tiny", iterations=3, params="model.*,!*norm*")
    assert cfg.params == ("model.*", "!*norm*") and cfg.iterations == 3
    assert ESConfig.from_dict(cfg.to_dict()) == cfg


# ---------------------------------------------------------------------------- noise and fitness


def test_noise_seeds_distinct_per_tensor_member_iteration():
    n_noise, n_tensors = 8, 40
    seeds = [noise_seed(0, it, k, t, n_noise, n_tensors)
             for it in range(1, 6) for k in range(n_noise) for t in range(n_tensors)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**32 for s in seeds)  # torch's CPU generator uses 32 bits of a seed
    assert len({_mix32(x, 12345) for x in range(100_000)}) == 100_000  # a bijection
    assert noise_seed(1, 1, 0, 0, n_noise, n_tensors) != noise_seed(0, 1, 0, 0, n_noise, n_tensors)
    assert member_noise(3, antithetic=True) == (1, -1) and member_noise(2, antithetic=True) == (1, 1)
    # the streams differ too, not just the seeds
    eng = _engine()
    a = eng._noise(1, 0, 0, 4).clone()
    assert not torch.equal(a, eng._noise(1, 1, 0, 4))
    assert not torch.equal(a, eng._noise(1, 0, 1, 4))
    assert not torch.equal(a, eng._noise(2, 0, 0, 4))
    assert torch.equal(a, eng._noise(1, 0, 0, 4))


def test_torch_generator_keeps_only_32_bits():
    """Why seeds are a bijection of a counter and not a 63-bit hash (see deltalens.training.es.strategy docstring)."""
    a = torch.randn(4, generator=torch.Generator().manual_seed(7))
    b = torch.randn(4, generator=torch.Generator().manual_seed(7 + 2**32))
    assert torch.equal(a, b)


def test_fitness_shaping():
    z = fitness_shaping([0.1, 0.5, 0.9, 0.5])
    assert abs(sum(z)) < 1e-12 and abs(sum(v * v for v in z) / 4 - 1) < 1e-12
    assert fitness_shaping([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    assert fitness_shaping([0.1, 0.5, 0.9, 0.5], "centered_rank") == [-0.5, 0.0, 0.5, 0.0]


def test_iteration_prompts_depend_only_on_seed_and_iteration():
    from deltalens.tasks import get_task

    cfg = ESConfig(prompts_per_iteration=5)
    a = [p.prompt for p in iteration_problems(get_task("arith"), cfg, 3)]
    assert a == [p.prompt for p in iteration_problems(get_task("arith"), cfg, 3)]
    assert a != [p.prompt for p in iteration_problems(get_task("arith"), cfg, 4)]


# ---------------------------------------------------------------------------- perturb / restore / update


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restore_is_exact(dtype):
    eng = _engine(dtype=dtype)
    before = weights(eng.model)
    timing = new_timing()
    eng.perturb(1, 2, timing)
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"],
                           eng.model.state_dict()["model.layers.0.mlp.up_proj.weight"])
    eng.restore(1, 2, timing)
    assert_same_weights(before, weights(eng.model))
    eng.evaluate_members(1, [0, 1], iteration_problems(eng.task, eng.config, 1))  # generate + score too
    assert_same_weights(before, weights(eng.model))


def test_tied_weights_perturbed_once():
    eng = _engine(tied=True)
    names = [n for _, n, _ in eng.params]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    before = eng.model.model.embed_tokens.weight.detach().clone()
    eng.perturb(1, 0, new_timing())
    assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight
    expected = before.add(eng.noise_of(1, 0, "model.embed_tokens.weight"), alpha=eng.config.sigma)
    assert torch.equal(eng.model.model.embed_tokens.weight, expected)  # once, not twice
    # a filter naming only the tied alias still selects the one tensor
    assert [n for _, n, _ in select_params(eng.model, ["lm_head.weight"])[0]] == ["model.embed_tokens.weight"]


@pytest.mark.parametrize(("antithetic", "dtype"), [(False, torch.float32), (True, torch.float32),
                                                   (False, torch.bfloat16)])
def test_update_matches_formula(antithetic, dtype):
    eng = _engine(antithetic=antithetic, params=("model.layers.1.*", "!*norm*"), dtype=dtype)
    before = weights(eng.model)
    z = [0.5, -1.0, 1.5, -1.0]
    eng.update(1, z)
    after = weights(eng.model)
    cfg = eng.config
    for _, name, p in eng.params:
        acc = torch.zeros(p.shape)
        for i, zi in enumerate(z):
            k, sign = member_noise(i, antithetic)
            acc += sign * zi * eng.noise_of(1, k, name)
        want = (before[name].float() + cfg.alpha / cfg.population * acc).to(dtype)  # rounded once
        tol = {"rtol": 0, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-6}
        torch.testing.assert_close(after[name], want, **tol)
        assert after[name].dtype == dtype
    trained = {n for _, n, _ in eng.params}
    assert all(torch.equal(before[k], after[k]) for k in before if k not in trained)
    assert "model.layers.1.mlp.up_proj.weight" in trained and "model.layers.1.input_layernorm.weight" not in trained


def test_blocks_and_threads_give_identical_results(monkeypatch):
    """Large tensors are cut into noise blocks; a thread pool over blocks changes nothing."""
    monkeypatch.setattr("deltalens.training.es.engine.CHUNK", 1000)
    monkeypatch.setattr("deltalens.training.es.engine.PARALLEL_MIN", 0)
    results = []
    for threads in (1, 3):
        eng = _engine(noise_threads=threads)
        assert (eng._pool is None) == (threads == 1)
        assert len(eng.blocks) > len(eng.params)  # e.g. the 99x32 embedding is 4 blocks
        assert len({b for _, _, b in eng.blocks}) == len(eng.blocks)
        before = weights(eng.model)
        timing = new_timing()
        eng.perturb(1, 1, timing)
        eng.restore(1, 1, timing)
        assert_same_weights(before, weights(eng.model))
        eng.update(1, [1.0, -0.5, 0.25, -0.75])
        results.append(weights(eng.model))
        eng.close()
    assert_same_weights(*results)


# ---------------------------------------------------------------------------- training runs


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted 4-iteration run on tiny (checkpoints at 2 and 4)."""
    spec = tiny_spec()
    torch.set_num_threads(1)
    cfg = ESConfig(model=spec, iterations=4, **FAST)
    out = train_es(cfg, tmp_path_factory.mktemp("es") / "ref")
    return cfg, out


def test_training_changes_weights(reference_run):
    from deltalens.io.models import load_model
    from deltalens.io.runs import RunDir

    cfg, out = reference_run
    base, _ = load_model(cfg.model)
    final = final_weights(out)
    assert any(not torch.equal(v, final[k]) for k, v in base.state_dict().items())
    rows = [r for r in RunDir(out).metrics() if "reward_mean" in r]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert any(r["reward_std"] > 0 for r in rows)
    r = rows[0]
    assert len(r["rewards"]) == len(r["seeds"]) == cfg.population
    assert set(r["timing"]) >= {"generation_s", "noise_s", "perturb_restore_s", "update_s", "iteration_s"}
    assert (out / "checkpoints" / "iter-000002" / "config.json").exists()
    assert RunDir(out).state()["iteration"] == 4
    # HF format: loadable by transformers directly
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "final")


def test_deterministic_under_fixed_seed(reference_run, tmp_path):
    cfg, out = reference_run
    cfg2_out = train_es(replace(cfg, iterations=2), tmp_path / "again")
    from deltalens.io.tensors import load_state_dict

    assert_same_weights(load_state_dict(out / "checkpoints" / "iter-000002" / "model.safetensors"),
                  final_weights(cfg2_out))


def test_resume_equals_uninterrupted(reference_run, tmp_path):
    from deltalens.io.runs import RunDir

    cfg, ref = reference_run

    def kill_in_iteration_3(done, total, row):
        if done == 3:  # row 3 is logged but its checkpoint is not: resume must redo iteration 3
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_es(cfg, tmp_path / "run", progress=kill_in_iteration_3)
    assert RunDir(tmp_path / "run").state()["iteration"] == 2
    with pytest.raises(DeltalensError, match="sigma"):
        train_es(replace(cfg, sigma=0.02), tmp_path / "run", resume=True)
    train_es(cfg, tmp_path / "run", resume=True)
    assert_same_weights(final_weights(ref), final_weights(tmp_path / "run"))
    rows = RunDir(tmp_path / "run").metrics()
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert rows == [{**r, "timing": rows[i]["timing"]} for i, r in enumerate(RunDir(ref).metrics())]


def test_without_keep_checkpoints_only_the_latest_is_kept_and_resumes(reference_run, tmp_path):
    """--no-keep-checkpoints: each checkpoint replaces the one before (its .pt too), a killed run resumes from the
    one left, and a finished run holds only final; the weights are the run's with every checkpoint kept."""
    cfg, ref = reference_run
    cfg = replace(cfg, checkpoint_every=1, keep_checkpoints=False, save_pt=True)
    ck = tmp_path / "run" / "checkpoints"

    def kill_after_iteration_3(done, total, row):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_es(cfg, tmp_path / "run", progress=kill_after_iteration_3)
    assert sorted(p.name for p in ck.iterdir()) == ["iter-000003", "iter-000003.pt"]
    train_es(cfg, tmp_path / "run", resume=True)
    assert sorted(p.name for p in ck.iterdir()) == ["final", "final.pt"]
    assert_same_weights(final_weights(ref), final_weights(tmp_path / "run"))


# ---------------------------------------------------------------------------- CLI


def test_cli_train_and_resume(tmp_path):
    """The old `train --method es` / `train --resume DIR` forms (aliases of `train es` / `train resume`)."""
    spec = tiny_spec()
    out = tmp_path / "es"
    args = ["train", "--method", "es", "--model", spec, "--task", "arith", "--out", str(out), "--iterations", "1",
            "--population", "2", "--prompts", "2", "--max-new-tokens", "8", "--eval-every", "1",
            "--eval-limit", "2", "--save-pt"]
    r = run_cli(args)
    assert r.exit_code == 0, r.output
    assert (out / "checkpoints" / "final.pt").exists() and (out / "config.json").exists()
    r = run_cli(args)  # refuses to overwrite
    assert r.exit_code == 2 and "--resume" in r.output
    r = run_cli(["train", "--resume", str(out), "--iterations", "2"])
    assert r.exit_code == 0, r.output
    from deltalens.io.runs import RunDir

    assert RunDir(out).state()["iteration"] == 2
    # growing a finished run moved the old final to iter-000001; final is the new end point
    assert (out / "checkpoints" / "iter-000001" / "config.json").exists()
    assert RunDir(out).state()["checkpoint"] == "final"
    r = run_cli(["train", "--resume", str(out), "--sigma", "0.5", "--iterations", "3"])
    assert r.exit_code == 2 and "sigma" in r.output
    r = run_cli(["train", "--method", "nope", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "No such command 'nope'" in r.output


def test_random_prompts_are_not_global_random():
    random.seed(1)
    from deltalens.tasks import get_task

    a = iteration_problems(get_task("arith"), ESConfig(), 1)
    random.seed(2)
    assert a == iteration_problems(get_task("arith"), ESConfig(), 1)
