"""Population-batched ES evaluation and low-rank noise (deltalens.es_population, deltalens.es_lowrank).

Equality claims tested here:
- full rank, batched vs one member at a time: member weights bit-identical, logits bit-identical on CPU
  (also with biases and tied embeddings), greedy responses and rewards identical on tiny, hence the
  same update bit for bit (a whole `train_es` run ends with identical weights);
- low rank, batched (never materialised) vs sequential (materialised in place): logits within fp32
  rounding, greedy responses identical on tiny for these seeds;
- the low-rank update equals the naive dense sum Σ z_i sign_i A_k B_kᵀ / √r.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support import run_cli, small_gemma3, small_llama, weights

from deltalens.errors import DeltalensError
from deltalens.training.es.backends.local import LocalBackend
from deltalens.training.es.config import ESConfig
from deltalens.training.es.engine import ESEngine, new_timing
from deltalens.training.es.population import Members, evaluate_batched, member_modules, member_weights
from deltalens.training.es.strategy import iteration_problems, member_noise
from deltalens.training.es.train import train_es
from deltalens.training.run import make_task

FAST = {"population": 4, "prompts_per_iteration": 8, "sigma": 0.01, "alpha": 0.005, "eval_every": 0,
        "checkpoint_every": 0, "max_new_tokens": 48, "antithetic": True}


def _small_model(tied=False, bias=False):
    model, tok = small_llama(tied=tied, bias=bias)
    if bias:  # random biases, so that they matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.02)
    return model, tok


def _engine(model, tok, **kw) -> ESEngine:
    cfg = ESConfig(**{"max_new_tokens": 4, "prompts_per_iteration": 2, "population": 4, **kw})
    return ESEngine(model, tok, make_task(cfg), cfg)


def _batch(tok, rows=3, length=7):
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, len(tok), (rows, length), generator=g)


def _member_logits_sequential(eng, iteration, members, ids):
    out = []
    for m in members:
        eng.perturb(iteration, m, new_timing())
        with torch.no_grad():
            out.append(eng.model(ids).logits)
        eng.restore(iteration, m, new_timing())
    return torch.stack(out)


def _member_logits_batched(eng, iteration, members, ids):
    weights = member_weights(eng, iteration, members, new_timing())
    with member_modules(eng.model, Members(weights, len(members))), torch.no_grad():
        logits = eng.model(ids.repeat(len(members), 1)).logits
    return logits.reshape(len(members), *ids.shape, -1)


# ---------------------------------------------------------------------------- config


def test_config_validation_says_what_to_change():
    with pytest.raises(DeltalensError, match="--noise"):
        ESConfig(noise="dense")
    with pytest.raises(DeltalensError, match="--rank"):
        ESConfig(noise="lowrank", rank=0)
    with pytest.raises(DeltalensError, match="needs --noise lowrank"):
        ESConfig(rank=4)
    with pytest.raises(DeltalensError, match="--population-batch 8 or less"):
        ESConfig(population=8, population_batch=16)
    with pytest.raises(DeltalensError, match="population_batch must be >= 0"):
        ESConfig(population_batch=-1)
    for backend in ("ray", "vllm"):
        with pytest.raises(DeltalensError, match="--backend local"):
            ESConfig(backend=backend, noise="lowrank")
        with pytest.raises(DeltalensError, match="--backend local"):
            ESConfig(backend=backend, population_batch=4)
    ESConfig(backend="ray", population_batch=1)  # 1 = one by one: allowed
    with pytest.raises(DeltalensError, match="local backend"):
        ESConfig(backend="ray", device="cuda")
    with pytest.raises(DeltalensError, match="device must be cpu, cuda, cuda:N or auto"):
        ESConfig(device="gpu")   # rejected before any run directory is written
    ESConfig(device="cuda:1")


def test_old_configs_load_with_defaults_and_new_fields_are_stored():
    old = {k: v for k, v in ESConfig().to_dict().items() if k not in ("noise", "rank", "population_batch")}
    cfg = ESConfig.from_dict(old)
    assert (cfg.noise, cfg.rank, cfg.population_batch) == ("full", 1, 0)
    d = ESConfig(noise="lowrank", rank=3, population_batch=4).to_dict()
    assert (d["noise"], d["rank"], d["population_batch"]) == ("lowrank", 3, 4)
    assert ESConfig.from_dict(json.loads(json.dumps(d))).rank == 3
    assert {"noise", "rank", "population_batch"} <= set(ESConfig.trajectory_fields())


# ---------------------------------------------------------------------------- low-rank noise


@pytest.mark.parametrize("antithetic", [False, True])
def test_lowrank_update_equals_dense_sum(antithetic):
    model, tok = _small_model()
    eng = _engine(model, tok, noise="lowrank", rank=2, antithetic=antithetic, alpha=0.01)
    before = weights(model)
    z = [0.5, -1.0, 1.5, -1.0]
    out = eng.update(3, z)
    after = weights(model)
    cfg, lr = eng.config, eng.lowrank
    sq = 0.0
    for j, (_, name, p) in enumerate(eng.params):
        want = torch.zeros(p.shape, dtype=torch.float64)
        for i, zi in enumerate(z):  # naive: one dense matrix per member
            k, sign = member_noise(i, antithetic)
            if p.dim() == 2:
                a, b = lr.factors(3, k, next(it for it in lr.items if it[0] == j))
                want += sign * zi * (a.double() @ b.double().T) / cfg.rank ** 0.5
            else:
                want += sign * zi * eng.noise_of(3, k, name).double()
        delta = cfg.alpha / cfg.population * want
        sq += float(delta.square().sum())
        torch.testing.assert_close(after[name].double(), before[name].double() + delta, rtol=0, atol=2e-7)
    assert out["update_rms"] == pytest.approx((sq / eng.n_trained) ** 0.5, rel=1e-6)
    assert len(lr.items) == sum(p.dim() == 2 for _, _, p in eng.params) > 0


def test_lowrank_perturb_is_rank_r_and_restore_exact():
    model, tok = _small_model()
    eng = _engine(model, tok, noise="lowrank", rank=3, antithetic=True)
    before = weights(model)
    name = "model.layers.0.mlp.up_proj.weight"
    eng.perturb(2, 1, new_timing())  # member 1 = -E_0
    delta = model.state_dict()[name] - before[name]
    torch.testing.assert_close(delta, -eng.config.sigma * eng.noise_of(2, 0, name), rtol=0, atol=1e-8)
    sv = torch.linalg.svdvals(delta.double())
    assert sv[2] > 0.1 * sv[0] and sv[3] < 1e-3 * sv[0]  # rank 3 up to fp32 rounding of W + δ
    norm = "model.layers.0.input_layernorm.weight"  # 1-D: dense noise, as with noise="full"
    full = _engine(*_small_model(), antithetic=True)
    assert torch.equal(eng.noise_of(2, 0, norm), full.noise_of(2, 0, norm))
    eng.restore(2, 1, new_timing())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_lowrank_noise_is_reconstructed_from_seeds():
    """Two fresh replicas draw the same factors; they differ across members, tensors and iterations;
    the diversity module's population rebuilds the members the run evaluated."""
    from deltalens.analysis.diversity import ESPopulation

    e1 = _engine(*_small_model(), noise="lowrank", rank=2)
    e2 = _engine(*_small_model(), noise="lowrank", rank=2)
    it0, it1 = e1.lowrank.items[0], e1.lowrank.items[1]
    a, b = e1.lowrank.factors(5, 1, it0)
    a2, b2 = e2.lowrank.factors(5, 1, e2.lowrank.items[0])
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert not torch.equal(a, e1.lowrank.factors(5, 2, it0)[0])
    assert not torch.equal(a, e1.lowrank.factors(6, 1, it0)[0])
    assert not torch.equal(a[:4], e1.lowrank.factors(5, 1, it1)[0][:4])
    model, tok = _small_model()
    pop = ESPopulation(model, tok, e1.task, e1.config, iteration=5)
    with pop.member(2) as m:
        rebuilt = weights(m)
    e1.perturb(5, 2, new_timing())
    assert all(torch.equal(v, rebuilt[k]) for k, v in weights(e1.model).items())
    flat = pop.noise(2)
    assert flat.numel() == e1.n_trained and abs(float(flat.std()) - 1) < 0.2  # unit-variance entries


# ---------------------------------------------------------------------------- batched forward


@pytest.mark.parametrize(("tied", "bias"), [(False, False), (True, True)])
def test_batched_full_rank_logits_bit_identical(tied, bias):
    eng = _engine(*_small_model(tied, bias), antithetic=True, sigma=0.05)
    ids, members = _batch(eng.tok), [0, 1, 3]
    before = weights(eng.model)
    seq = _member_logits_sequential(eng, 1, members, ids)
    bat = _member_logits_batched(eng, 1, members, ids)
    assert torch.equal(seq, bat)
    assert all(torch.equal(v, eng.model.state_dict()[k]) for k, v in before.items())  # model untouched
    assert "forward" not in eng.model.lm_head.__dict__  # forwards restored
    # member weights are bit-identical to the in-place perturbation, antithetic pairs mirrored
    w = member_weights(eng, 1, [0, 1], new_timing())
    eng.perturb(1, 1, new_timing())
    p = eng.model.model.layers[0].mlp.down_proj.weight
    assert torch.equal(w[(p.data_ptr(), tuple(p.shape))][1], p)


@pytest.mark.parametrize(("tied", "bias"), [(False, False), (True, True)])
def test_batched_lowrank_logits_match_sequential(tied, bias):
    eng = _engine(*_small_model(tied, bias), noise="lowrank", rank=2, antithetic=True, sigma=0.05)
    ids, members = _batch(eng.tok), [0, 1, 2]
    seq = _member_logits_sequential(eng, 4, members, ids)
    bat = _member_logits_batched(eng, 4, members, ids)
    centre = eng.model(ids).logits.detach()
    torch.testing.assert_close(bat, seq, rtol=1e-5, atol=1e-5)
    assert (seq[0] - centre).abs().max() > 1e-3  # the perturbation is visible
    w = member_weights(eng, 4, [0, 1], new_timing())  # antithetic: A of member 1 = -A of member 0
    a, b = w[(eng.lowrank.items[0][2].data_ptr(), tuple(eng.lowrank.items[0][2].shape))]
    assert torch.equal(a[1], -a[0]) and torch.equal(b[1], b[0])


@pytest.mark.parametrize("noise", ["full", "lowrank"])
def test_gemma3_members_batched_match_sequential(noise):
    """Gemma 3 (`small_gemma3`: random norm weights acting as 1 + w, the √hidden-scaled embedding, q/k norms, a
    sliding-window layer, tied): full rank bit-identical to one member at a time, low rank within fp32
    rounding. Dropping the embedding's scale or reading a norm as w would move the logits by O(1)."""
    model, tok = small_gemma3(sliding=True)
    kw = {"noise": "lowrank", "rank": 2} if noise == "lowrank" else {}
    eng = _engine(model, tok, antithetic=True, sigma=0.05, **kw)
    ids, members = _batch(eng.tok, length=20), [0, 1, 3]  # 20 tokens: past the sliding window of 16
    seq = _member_logits_sequential(eng, 2, members, ids)
    bat = _member_logits_batched(eng, 2, members, ids)
    if noise == "full":
        assert torch.equal(seq, bat)
    else:
        torch.testing.assert_close(bat, seq, rtol=1e-5, atol=1e-5)
    assert (seq[0] - eng.model(ids).logits.detach()).abs().max() > 1e-3  # the perturbation is visible


def test_norm_and_embedding_kinds_known_answers():
    from torch import nn
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, Gemma3TextScaledWordEmbedding
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from deltalens.training.es import population as pop

    llama, gemma = LlamaRMSNorm(6, eps=1e-5), Gemma3RMSNorm(6, eps=1e-6)
    with torch.no_grad():
        llama.weight.normal_()
        gemma.weight.normal_()
    assert pop._norm_kind(llama) == (1e-5, "llama") and pop._norm_kind(gemma) == (1e-6, "gemma")
    assert pop._norm_kind(nn.LayerNorm(6)) is None
    plain, scaled = nn.Embedding(10, 4), Gemma3TextScaledWordEmbedding(10, 4, 0, embed_scale=2.0)
    assert pop._embedding_scale(plain) is None and float(pop._embedding_scale(scaled)) == 2.0

    class Odd(nn.Embedding):  # a forward of its own that is not rows x a constant
        def forward(self, ids):
            return super().forward(ids) + 1

    class OddLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x).relu()

    for mod, what in ((Odd(10, 4), "an Embedding with a forward of its own"),
                      (OddLinear(4, 4), "a Linear with a forward of its own")):
        seq = nn.Sequential(mod)
        with pytest.raises(DeltalensError, match=what), \
                member_modules(seq, Members({(mod.weight.data_ptr(), tuple(mod.weight.shape)): None}, 2)):
            pass


def test_unsupported_module_and_memory_errors(monkeypatch):
    from torch import nn

    ln = nn.Sequential(nn.LayerNorm(4))
    with pytest.raises(DeltalensError, match="--params"), member_modules(ln, Members({(ln[0].weight.data_ptr(), (4,)): None}, 2)):
        pass
    eng = _engine(*_small_model(), population_batch=4)
    monkeypatch.setattr("deltalens.training.es.population.available_memory", lambda device: 100_000)
    with pytest.raises(DeltalensError, match="--noise lowrank"):
        member_weights(eng, 1, [0, 1, 2, 3], new_timing())


# ---------------------------------------------------------------------------- rewards and training on tiny


def _responses(eng, iteration, problems):
    """Rewards and the completions behind them, members one by one or batched per config."""
    seen = []
    score = eng.mean_reward
    eng.mean_reward = lambda completions, probs, timing=None: seen.append(list(completions)) or score(completions, probs)
    rewards, _ = LocalBackend(eng).evaluate(iteration, problems)  # batched when population_batch > 1
    del eng.mean_reward
    rewards = dict(enumerate(rewards))
    return rewards, seen


@pytest.mark.parametrize(("noise", "batch_tokens", "over"), [
    ("full", None, {}), ("lowrank", None, {}), ("full", 200, {}),
    ("lowrank", 200, {"sigma": 0.03, "population": 8}),   # large enough σ that low-rank members end apart
])
def test_batched_rewards_equal_sequential_on_tiny(noise, batch_tokens, over, monkeypatch):
    """batch_tokens=200 cuts the 8 prompts into 3 batches (on both paths); members are retired."""
    from deltalens.io.models import load_model
    from deltalens.training.es.population import Members

    torch.set_num_threads(1)
    model, tok = load_model("tiny")
    cfg = ESConfig(model="tiny", noise=noise, rank=1, **{**FAST, **over})
    retired = []
    retire = Members.retire
    monkeypatch.setattr(Members, "retire", lambda self, keep: retired.append(len(keep)) or retire(self, keep))
    monkeypatch.setattr("deltalens.training.es.population.SEGMENT", 4 if batch_tokens else 16)
    out = {}
    n = cfg.population
    for pb in (0, n):
        eng = ESEngine(model, tok, make_task(cfg), dataclasses.replace(cfg, population_batch=pb))
        eng.generator.batch_tokens = batch_tokens or eng.generator.batch_tokens
        out[pb] = _responses(eng, 1, iteration_problems(eng.task, cfg, 1))
    assert out[0][0] == out[n][0]  # rewards: identical floats
    assert out[0][1] == out[n][1]  # every completion of every member
    assert len(set(out[0][0].values())) > 1
    assert retired or not batch_tokens  # with small batches some member ends first and leaves the batch


def test_generate_replicated_equals_hf_backend():
    """Segmented generation of R replicas of the centre = HFBackend.generate, per replica, also when
    the prompts span several batches."""
    from deltalens.generation import HFBackend, SamplingParams
    from deltalens.io.models import load_model
    from deltalens.tasks import get_task
    from deltalens.training.es.population import generate_replicated

    model, tok = load_model("tiny")
    prompts = [p.prompt for p in iteration_problems(get_task("arith"), ESConfig(prompts_per_iteration=7), 1)]
    gen = HFBackend(model, tok, batch_tokens=250)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=48)
    want = [c[0] for c in gen.generate(prompts, params)]
    for segment in (5, None):
        got = generate_replicated(gen, prompts, 3, params, segment=segment)
        assert got == [want] * 3


def test_train_es_batched_equals_sequential_bit_for_bit(tmp_path):
    from deltalens.io.runs import RunDir
    from deltalens.io.tensors import load_state_dict

    torch.set_num_threads(1)
    cfg = ESConfig(model="tiny", iterations=2, **FAST)
    finals, rows = [], []
    for pb in (0, 2):  # 2 members per batch: two groups per iteration
        out = train_es(dataclasses.replace(cfg, population_batch=pb), tmp_path / f"pb{pb}")
        finals.append(load_state_dict(out / "checkpoints" / "final" / "model.safetensors"))
        rows.append([(r["rewards"], r["checksum"]) for r in RunDir(out).metrics()])
    assert rows[0] == rows[1]
    assert all(torch.equal(v, finals[1][k]) for k, v in finals[0].items())


def test_evaluate_batched_with_sampling_runs():
    """temperature > 0: the batched path samples (its own random stream, see the module docstring)."""
    eng = _engine(*_small_model(), population_batch=4, temperature=0.8)
    probs = iteration_problems(eng.task, eng.config, 1)
    r = evaluate_batched(eng, 1, [0, 1, 2, 3], probs, new_timing())
    assert sorted(r) == [0, 1, 2, 3]


def test_cli_lowrank_batched_train_and_resume(tmp_path):
    from deltalens.io.runs import RunDir

    out = tmp_path / "es"
    args = ["train", "es", "--model", "tiny", "--task", "arith", "--out", str(out), "--iterations", "1",
            "--population", "4", "--prompts", "2", "--max-new-tokens", "8", "--eval-every", "0",
            "--noise", "lowrank", "--rank", "2", "--population-batch", "4"]
    r = run_cli(args)
    assert r.exit_code == 0, r.output
    cfg = RunDir(out).config()
    assert (cfg["noise"], cfg["rank"], cfg["population_batch"]) == ("lowrank", 2, 4)
    r = run_cli(["train", "resume", str(out), "--iterations", "2"])
    assert r.exit_code == 0, r.output
    assert RunDir(out).state()["iteration"] == 2
    # the diversity tools rebuild the run's low-rank members from seeds (fewer members than the batch too)
    from deltalens.analysis.diversity import load_population

    pop, info = load_population(str(out), make_task(ESConfig()), iteration=1, members=2)
    assert (pop.config.noise, pop.config.rank, pop.size) == ("lowrank", 2, 2) and info["centre_checksum"] == "verified"
    with pop.member(1):
        pass
    pop.close()
    r = run_cli(["train", "--resume", str(out), "--noise", "full", "--rank", "1", "--iterations", "3"])
    assert r.exit_code == 2 and "noise" in r.output
    r = run_cli(args[:-6] + ["--out", str(tmp_path / "x"), "--rank", "2"])
    assert r.exit_code == 2 and "--noise lowrank" in r.output


# ---------------------------------------------------------------------------- a shared prompt prefix


def test_common_prefix_known_answers():
    from deltalens.training.es.population import common_prefix

    assert common_prefix([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9, 9, 9]]) == 2
    assert common_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2  # the shortest keeps a token of its own
    assert common_prefix([[5], [5, 6]]) == 0
    assert common_prefix([[1, 2], [3, 4]]) == 0


@pytest.mark.parametrize("noise", ["lowrank", "full"])
def test_shared_prefix_gives_the_completions_of_the_copies(noise, monkeypatch):
    """Population batching with each member's few-shot prefix prefilled once and read in place gives every
    member's completions of the unshared batch (fp32, greedy, tiny): several batches, members retired
    between segments; and the sharing is really taken."""
    from deltalens.generation import shared_prefix as sp
    from deltalens.io.models import load_model
    from deltalens.training.es import population as pop_mod

    torch.set_num_threads(1)
    model, tok = load_model("tiny")
    cfg = ESConfig(model="tiny", task="add:digits=1-2,terms=2,shots=2", noise=noise, population_batch=4,
                   **{**FAST, "sigma": 0.03, "max_new_tokens": 24})
    monkeypatch.setattr(pop_mod, "SEGMENT", 4)
    taken, retired = [], []
    prefill, part, retire = pop_mod.prefill_prompts, sp._prefix_part, Members.retire
    monkeypatch.setattr(pop_mod, "prefill_prompts", lambda *a: taken.append(a[1].shape[1]) or prefill(*a))
    monkeypatch.setattr(sp, "_prefix_part", lambda *a: taken.append("step") or part(*a))
    monkeypatch.setattr(Members, "retire", lambda self, keep: retired.append(len(keep)) or retire(self, keep))
    out = {}
    for shared in (False, True):
        eng = ESEngine(model, tok, make_task(cfg), dataclasses.replace(cfg, shared_prefix=shared))
        eng.generator.batch_tokens = 600  # the 8 prompts in 2 batches
        out[shared] = _responses(eng, 1, iteration_problems(eng.task, cfg, 1))
        if not shared:
            assert not taken
    assert out[True] == out[False]
    completions = [c for member in out[True][1] for c in member]
    assert len(set(completions)) > 4  # members wrote different things
    prefixes = [n for n in taken if n != "step"]
    assert len(prefixes) == 2 and min(prefixes) >= 90  # two batches, each its ~100-token few-shot prefix
    assert taken.count("step") > 0 and retired


def test_shared_prefix_option():
    """On by default with population batching; refused where it means nothing; a run recorded before the
    option read back as what it ran with (no sharing)."""
    assert ESConfig(population=4, population_batch=4).shared_prefix is True
    with pytest.raises(DeltalensError, match="--shared-prefix is only used when --population-batch is 2 or more"):
        ESConfig.resolve(given={"shared_prefix": False})
    old = {k: v for k, v in ESConfig(population=4, population_batch=4).to_dict().items() if k != "shared_prefix"}
    assert ESConfig.from_dict(old).shared_prefix is False
    assert ESConfig.run_options(old)["shared_prefix"] is False
    one_by_one = {k: v for k, v in ESConfig().to_dict(in_use=True).items()}
    assert "shared_prefix" not in one_by_one and ESConfig.from_dict(one_by_one).shared_prefix is True
    assert "shared_prefix" in ESConfig.trajectory_fields()
