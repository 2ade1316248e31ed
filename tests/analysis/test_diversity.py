"""Population diversity: formulas by hand, scoring = sampling distribution, known JS values (0, log 2,
an exact two-member value), exact member reconstruction (fresh noise and an ES run), CLI, small-σ law."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support import small_llama, tiny_spec

from deltalens.analysis.diversity import (
    ESPopulation,
    ModelPopulation,
    binary_entropy,
    coverage,
    diversity_section,
    encode_prompts,
    js_from_logprobs,
    js_success,
    load_population,
    population_divergence,
    sample_responses,
    sequence_logprobs,
)
from deltalens.errors import DeltalensError
from deltalens.schema import validate
from deltalens.tasks import Problem, Task, get_task


def _small_model(seed: int = 0):
    return small_llama(seed=seed)


T = 0.6


def _bigram_model(tok, rows: dict[str, tuple[float, dict[str, float]]]):
    """A 1-layer Llama that is exactly a bigram model: next-token logits depend only on the current token.

    Attention and MLP outputs are zero, so the residual stream is the embedding, a one-hot vector per
    token (hidden >= vocab); the final RMSNorm scales it by s, and lm_head[:, v] = logits(v -> .) / s.
    rows[c] = (default logit, {next token: logit}) after token c; logits after other tokens are 0.
    """
    from transformers import LlamaForCausalLM

    from deltalens.tiny.build import build_config

    vocab = len(tok)
    cfg = build_config(vocab, hidden=128, layers=1, heads=2, kv_heads=1, intermediate=8)
    model = LlamaForCausalLM(cfg).eval()
    s = 1.0 / math.sqrt(1.0 / cfg.hidden_size + cfg.rms_norm_eps)

    def tid(c):
        return tok.eos_token_id if c == "<eos>" else tok.convert_tokens_to_ids(c)

    head = torch.zeros(vocab, vocab)  # head[next, current] = logit
    for c, (default, logits) in rows.items():
        head[:, tid(c)] = default
        for d, logit in logits.items():
            head[tid(d), tid(c)] = logit
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        model.model.embed_tokens.weight[torch.arange(vocab), torch.arange(vocab)] = 1.0
        model.lm_head.weight[:, :vocab].copy_(head / s)
    return model


class LetterTask(Task):
    """Prompt 'Q: 1+1=?\\nA:'; a completion is correct iff it equals the answer exactly."""

    name = "letters"
    max_new_tokens = 4

    def __init__(self, answer: str = "a"):
        super().__init__()
        self.answer = answer

    def _make_split(self, name):
        return [Problem("Q: 1+1=?\nA:", self.answer)]

    def score_problem(self, completion, problem):
        return 1.0 if completion == problem.answer else 0.0


def _letters(probs: dict[str, float]) -> dict:
    """Bigram rows: after ':' one of `probs`' letters with exactly those probabilities at temperature T
    (every other token at logit -30), then EOS (logit 40 against 0)."""
    return {":": (-30.0, {ch: T * math.log(p) for ch, p in probs.items()}),
            **{ch: (0.0, {"<eos>": 40.0}) for ch in "abc"}}


# ----------------------------------------------------------------------------------------------- formulas


def test_formulas_by_hand():
    assert binary_entropy(0.0) == binary_entropy(1.0) == 0.0
    assert binary_entropy(0.5) == pytest.approx(math.log(2))
    assert js_success([0.0, 1.0]) == pytest.approx(math.log(2))
    assert js_success([0.3, 0.3, 0.3]) == pytest.approx(0.0)
    # h(0.4) - (h(0.2) + h(0.6)) / 2, by hand
    def h(p):
        return -p * math.log(p) - (1 - p) * math.log(1 - p)

    assert js_success([0.2, 0.6]) == pytest.approx(h(0.4) - (h(0.2) + h(0.6)) / 2)
    cov = coverage([0.5, 0.2], p_centre=0.3)
    assert cov["population"] == pytest.approx(1 - 0.5 * 0.8)  # 0.6
    assert cov["bound_rhs"] == pytest.approx(1 - 0.65 ** 2)  # 0.5775
    assert cov["centre"] == pytest.approx(1 - 0.7 ** 2)  # 0.51
    assert cov["holds"]
    eq = coverage([0.4, 0.4, 0.4])
    assert eq["population"] == pytest.approx(eq["bound_rhs"]) and eq["centre"] is None


def test_js_from_logprobs_by_hand():
    # two members, one sample each: y0 ~ π0 with π0(y0)=.5, π1(y0)=.25; y1 ~ π1 with π0(y1)=.1, π1(y1)=.4
    logp = torch.log(torch.tensor([[[0.5], [0.1]], [[0.25], [0.4]]], dtype=torch.float64))  # [j, i, m]
    r = js_from_logprobs(logp)
    d0 = math.log(0.5 / ((0.5 + 0.25) / 2))
    d1 = math.log(0.4 / ((0.1 + 0.4) / 2))
    assert r["js"] == pytest.approx((d0 + d1) / 2)
    assert r["kl"] == pytest.approx([d0, d1])

    def mi(a, b):  # log 2 - H(posterior over members)
        w = [a / (a + b), b / (a + b)]
        return math.log(2) + sum(x * math.log(x) for x in w)

    assert r["js_mi"] == pytest.approx((mi(0.5, 0.25) + mi(0.1, 0.4)) / 2)
    assert r["se_kind"] == "pooled"
    same = js_from_logprobs(torch.full((3, 3, 4), -7.0, dtype=torch.float64))
    assert same["js"] == same["js_se"] == 0.0 and abs(same["js_mi"]) < 1e-12 and same["se_kind"] == "stratified"


def test_the_reported_js_estimator_on_two_distributions_by_hand():
    """P = (1/2, 1/2) and Q = (9/10, 1/10) over two responses A, B; M = (P + Q)/2 = (7/10, 3/10):
    JS = ½ KL(P‖M) + ½ KL(Q‖M) = ½ (½ ln(5/7) + ½ ln(5/3)) + ½ (9/10 ln(9/7) + 1/10 ln(1/3)) = 0.1017492 nats.
    Samples in exact proportion (P: 5 A, 5 B; Q: 9 A, 1 B) make every sample mean an expectation, so the
    reported (posterior) estimator, log 2 − H(w(y)) averaged over the pooled samples, is JS itself, and the
    direct one agrees: both are unbiased, they differ in variance only (estimators.py)."""
    from deltalens.analysis.diversity import ESTIMATOR

    p, q = {"A": 0.5, "B": 0.5}, {"A": 0.9, "B": 0.1}
    samples = [["A"] * 5 + ["B"] * 5, ["A"] * 9 + ["B"] * 1]  # member i's 10 responses
    logp = torch.tensor([[[math.log(pi[y]) for y in samples[i]] for i in range(2)] for pi in (p, q)],
                        dtype=torch.float64)  # [j, i, m] = log π_j(y_im)
    r = js_from_logprobs(logp)
    assert ESTIMATOR == "posterior"
    assert r["js_mi"] == pytest.approx(0.1017492, abs=1e-7)
    assert r["js"] == pytest.approx(0.1017492, abs=1e-7)
    assert r["js_mi_se"] < r["js_se"]  # the reason for the choice: the same JS with less Monte Carlo error


# ----------------------------------------------------------------------------------------- sample / score


def _naive_scores(model, pids, items, temperature):
    """log π_T(y | x) and the summed next-token entropies at T, one prefix at a time, no cache."""
    logp, ent = [], []
    with torch.no_grad():
        for p, y in items:
            lp_sum = h_sum = 0.0
            for t in range(len(y)):
                logits = model(input_ids=torch.tensor([pids[p] + list(y[:t])])).logits[0, -1].float()
                lp = (logits / temperature).log_softmax(-1)
                lp_sum += float(lp[y[t]])
                h_sum += float(-(lp.exp() * lp).sum())
            logp.append(lp_sum)
            ent.append(h_sum)
    return logp, ent


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3-sliding"])
def test_scores_match_a_naive_loop_for_any_batching(arch):
    """Batched teacher forcing over each prompt's KV cache (prompts of several lengths left padded in one
    batch, responses right padded, logits / T, EOS included) = one-prefix-at-a-time forward passes, for
    one batch or many; entropies too. Samples end at their first EOS or after max_new_tokens tokens."""
    from support import small_gemma3, small_qwen2

    model, tok = {"llama": _small_model, "qwen2": small_qwen2,
                  "gemma3-sliding": lambda: small_gemma3(sliding=True)}[arch]()
    prompts = ["Q: 1+2=?\nA:", "Q: 12+34-5+6=?\nA:", "x"]
    pids = encode_prompts(tok, prompts)
    out = sample_responses(model, tok, pids, 2, temperature=0.7, max_new_tokens=6, seed=3)
    eos = tok.eos_token_id
    for rows in out:
        for y in rows:
            assert (eos in y and y.index(eos) == len(y) - 1) or (eos not in y and len(y) == 6)
    items = [(p, y) for p in range(3) for y in out[p]] + [(0, (5, 7, eos)), (2, (eos,)), (1, (9,) * 6), (1, ())]
    naive, naive_ent = _naive_scores(model, pids, items, 0.7)
    one = sequence_logprobs(model, pids, items, 0.7, entropy=True)
    many = sequence_logprobs(model, pids, items, 0.7, entropy=True, token_budget=40)  # several batches
    tiny = sequence_logprobs(model, pids, items, 0.7, logit_budget=1)  # one item per batch
    for got in (one, many, tiny):
        assert got["logp"].tolist() == pytest.approx(naive, abs=1e-4)
    assert one["entropy"].tolist() == pytest.approx(naive_ent, abs=1e-4)
    assert many["entropy"].tolist() == pytest.approx(naive_ent, abs=1e-4)
    assert one["tokens"].tolist() == [len(y) for _, y in items]
    assert got["logp"][-1] == 0.0  # an empty response: probability 1 of nothing more
    with pytest.raises(DeltalensError, match="temperature"):
        sample_responses(model, tok, pids, 1, temperature=0.0, max_new_tokens=2, seed=0)


def test_scores_of_a_model_without_logits_to_keep_and_the_budget_that_bounds_its_prefill():
    """A forward without `logits_to_keep` returns the prompts' logits at every position: the logit budget
    then counts them (distinct prompts x longest prompt x vocabulary), and the scores do not change."""
    from transformers import LlamaForCausalLM

    from deltalens.analysis.diversity.sampling import _batches

    class NoKeep(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None, **cache):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=use_cache, **cache)

    model, tok = _small_model()
    plain = NoKeep(model.config).eval()
    plain.load_state_dict(model.state_dict())
    pids = encode_prompts(tok, ["Q: 1+2=?\nA:", "Q: 12+34-5+6=?\nA:"])
    items = [(0, (5, 7, tok.eos_token_id)), (0, (9,)), (1, (4, 4)), (1, (8, 8, 8, 8))]
    naive, _ = _naive_scores(model, pids, items, 0.7)
    vocab = len(tok)
    for budget in (1 << 26, 30 * vocab):
        assert sequence_logprobs(plain, pids, items, 0.7, logit_budget=budget)["logp"].tolist() == \
            pytest.approx(naive, abs=1e-4)
    plen, rlen, prompt = [len(pids[p]) for p, _ in items], [len(y) for _, y in items], [p for p, _ in items]
    for batch in _batches(plen, rlen, prompt, list(range(4)), vocab, 65_536, 30 * vocab, prompt_logits=True):
        distinct = len({prompt[k] for k in batch})
        need = len(batch) * max(rlen[k] for k in batch) + distinct * max(plen[k] for k in batch)
        assert len(batch) == 1 or need <= 30
    assert [len(b) for b in _batches(plen, rlen, prompt, list(range(4)), vocab, 65_536, 30 * vocab, True)] != \
        [len(b) for b in _batches(plen, rlen, prompt, list(range(4)), vocab, 65_536, 30 * vocab, False)]


def test_scoring_only_empty_responses_still_reports_progress():
    model, tok = _small_model()
    pids = encode_prompts(tok, ["x", "y"])
    seen = []
    got = sequence_logprobs(model, pids, [(0, ()), (1, ())], 0.7, entropy=True, progress=seen.append)
    assert seen == [2] and got["logp"].tolist() == [0.0, 0.0] and got["tokens"].tolist() == [0, 0]


def test_samples_are_seeded_and_reported_as_they_come():
    model, tok = _small_model()
    pids = encode_prompts(tok, ["Q: 1+2=?\nA:", "Q: 3+4=?\nA:"])
    seen = []
    a = sample_responses(model, tok, pids, 3, temperature=0.9, max_new_tokens=5, seed=11, progress=seen.append)
    b = sample_responses(model, tok, pids, 3, temperature=0.9, max_new_tokens=5, seed=11, batch_tokens=20)
    c = sample_responses(model, tok, pids, 3, temperature=0.9, max_new_tokens=5, seed=12)
    assert a == sample_responses(model, tok, pids, 3, temperature=0.9, max_new_tokens=5, seed=11)
    assert seen[-1] == 6 and seen == sorted(seen)
    assert a != c and [len(r) for r in b] == [3, 3]


def test_bigram_samples_follow_the_scored_distribution():
    """Sample frequencies match the exact probabilities, and the scorer returns them (EOS included)."""
    from deltalens.tiny.build import build_tokenizer

    tok = build_tokenizer()
    q = {"a": 0.6, "b": 0.3, "c": 0.1}
    model = _bigram_model(tok, _letters(q))
    pids = encode_prompts(tok, ["Q: 1+1=?\nA:"])
    out = sample_responses(model, tok, pids, 400, temperature=T, max_new_tokens=4, seed=0)[0]
    eos = tok.eos_token_id
    for ch, p in q.items():
        y = (tok.convert_tokens_to_ids(ch), eos)
        assert abs(out.count(y) / 400 - p) < 0.07
        assert math.exp(float(sequence_logprobs(model, pids, [(0, y)], T)["logp"][0])) == pytest.approx(p, abs=1e-5)
    assert len(set(out)) == 3


# --------------------------------------------------------------------------------------- known JS values


def _exact_js(qs: list[dict[str, float]]) -> float:
    keys = sorted({k for q in qs for k in q})
    mix = {k: sum(q.get(k, 0.0) for q in qs) / len(qs) for k in keys}
    def H(d):
        return -sum(v * math.log(v) for v in d.values() if v > 0)

    return H(mix) - sum(H(q) for q in qs) / len(qs)


def test_js_of_two_known_members_matches_the_exact_value():
    from deltalens.tiny.build import build_tokenizer

    tok = build_tokenizer()
    qa, qb = {"a": 0.6, "b": 0.3, "c": 0.1}, {"a": 0.1, "b": 0.3, "c": 0.6}
    pop = ModelPopulation([_bigram_model(tok, _letters(qa)), _bigram_model(tok, _letters(qb))], tok)
    task = LetterTask("a")
    r = population_divergence(pop, task, task.test(), samples=150, temperature=T, seed=1)
    exact = _exact_js([qa, qb])  # ≈ 0.133 nats
    # the reported estimator (js_mean) is the posterior one; the direct one is kept beside it
    assert r["estimator"] == "posterior" and r["js_mean"] == r["js_mi_mean"] and r["js_se"] == r["js_mi_se"]
    assert abs(r["js_mean"] - exact) < 4 * r["js_se"] and r["js_se"] < 0.02
    assert abs(r["js_direct_mean"] - exact) < 4 * r["js_direct_se"] and r["js_direct_se"] < 0.04
    assert r["per_prompt"][0]["js"] == r["per_prompt"][0]["js_mi"] != r["per_prompt"][0]["js_direct"]
    assert r["coverage_centre"] is None and r["token_entropy"] is None  # no centre given


def test_disjoint_members_give_log2_and_the_success_formulas():
    """Member A always answers 'a' (correct), B always 'b': JS = log 2, JS_succ = log 2, population
    covers the problem, the bound's right side is 1 - (1/2)^2, the centre (= A) has p = 1."""
    from deltalens.tiny.build import build_tokenizer

    tok = build_tokenizer()
    a, b = _bigram_model(tok, _letters({"a": 1.0})), _bigram_model(tok, _letters({"b": 1.0}))
    pop = ModelPopulation([a, b], tok, centre=a)
    task = LetterTask("a")
    r = population_divergence(pop, task, task.test(), samples=8, temperature=T, seed=0)
    assert r["js_mean"] == pytest.approx(math.log(2), abs=1e-6)
    assert r["js_mi_mean"] == pytest.approx(math.log(2), abs=1e-6)
    assert r["per_prompt"][0]["p_members"] == [1.0, 0.0]
    assert r["js_succ_mean"] == pytest.approx(math.log(2))
    assert r["coverage_population"] == pytest.approx(1.0)
    assert r["coverage_bound"] == {"lhs": pytest.approx(1.0), "rhs": pytest.approx(0.75), "holds": True}
    assert r["p_centre_mean"] == 1.0 and r["coverage_centre"] == pytest.approx(1.0)
    assert r["token_entropy"] == pytest.approx(0.0, abs=1e-4)  # a deterministic centre
    assert r["cost"]["distinct_pairs"] == 2  # 16 samples, two distinct responses, scored once each


def test_sigma_zero_gives_zero_js_and_a_schema_entry(rand_model_dir):
    d = diversity_section(str(rand_model_dir), "add:digits=1-2,shots=2", members=3, sigma=0.0, prompts=2,
                          samples=2, max_new_tokens=6)
    assert d["task"] == "add:digits=1-2,terms=2,ops=+,shots=2"  # the spec it sampled, shots included
    assert d["estimator"] == "posterior"
    assert d["js_mean"] == pytest.approx(0.0, abs=1e-9) and abs(d["js_mean"]) <= 3 * d["js_se"] + 1e-9
    assert d["js_direct_mean"] == pytest.approx(0.0, abs=1e-9)
    assert d["js_mi_mean"] == pytest.approx(0.0, abs=1e-9)
    assert d["js_succ_mean"] == 0.0
    for key in ("sigma", "members", "prompts", "samples", "js_mean", "js_se", "js_succ_mean",
                "coverage_population", "coverage_centre", "token_entropy", "per_prompt"):
        assert key in d
    assert (d["sigma"], d["members"], d["prompts"], d["samples"]) == (0.0, 3, 2, 2)
    assert set(d["per_prompt"][0]) >= {"prompt", "js", "js_se", "js_succ", "p_members"}
    assert len(d["per_prompt"][0]["p_members"]) == 3
    json.dumps(d, allow_nan=False)  # plain JSON (null, not NaN)


# ------------------------------------------------------------------------------------ reconstruction


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("antithetic", [False, True])
def test_members_are_exactly_esengine_perturbations(antithetic):
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.engine import ESEngine

    cfg = ESConfig(population=4, sigma=0.01, seed=7, antithetic=antithetic, params=("*", "!*norm*"))
    model, tok = _small_model()
    before = _state(model)
    task = get_task("arith")
    pop = ESPopulation(model, tok, task, cfg, iteration=3)
    ref_model, _ = _small_model()
    ref = ESEngine(ref_model, tok, task, cfg)
    timing = {"noise_s": 0.0, "perturb_restore_s": 0.0}
    for i in range(4):
        with pop.member(i) as m:
            ref.perturb(3, i, timing)
            mine, theirs = _state(m), _state(ref_model)
            ref.restore(3, i, timing)
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
        assert any(not torch.equal(mine[k], before[k]) for k in mine)
        assert all(torch.equal(v, before[k]) for k, v in _state(model).items())  # restored bit-exactly
        flat = torch.cat([(mine[name] - before[name]).flatten() for _, name, _ in pop.engine.params])
        assert torch.allclose(flat, 0.01 * pop.noise(i), atol=1e-6)  # the noise the law uses is the same ε


def test_run_population_is_the_runs_own(rand_model_dir, tmp_path):
    """Centre = saved checkpoint (checksum verified), members = the run's next population: same seeds,
    and re-evaluating them reproduces the rewards the run logged."""
    from deltalens.io.runs import RunDir
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.train import train_es

    cfg = ESConfig(model=str(rand_model_dir), task="arith", population=4, sigma=0.05, alpha=0.05,
                   prompts_per_iteration=4, max_new_tokens=4, iterations=3, eval_every=0, checkpoint_every=2)
    run = train_es(cfg, tmp_path / "run")
    rows = {r["iteration"]: r for r in RunDir(run).metrics()}
    task = get_task("arith")
    pop, info = load_population(str(run), task, iteration=2)
    assert (info["centre_iteration"], info["noise"]["iteration"], info["centre_checksum"]) == (2, 3, "verified")
    assert pop.sigma == 0.05 and pop.size == 4 and not info["notes"]
    assert pop.engine.member_seeds(3) == rows[3]["seeds"]
    got = pop.engine.evaluate_members(3, range(4))
    assert [got[i] for i in range(4)] == rows[3]["rewards"]

    _, final = load_population(str(run), task, iteration=3)
    assert final["centre"].endswith("final") and final["centre_checksum"] == "verified"
    _, near = load_population(str(run), task, iteration=1)  # not saved: 0 (base) and 2 tie, the earlier wins
    assert near["centre_iteration"] == 0 and "nearest" in near["notes"][0]
    _, over = load_population(str(run), task, iteration=2, members=6, sigma=0.01)
    assert "differs from the run's" in over["notes"][0]
    with pytest.raises(DeltalensError, match="ES run directory"):
        load_population(str(rand_model_dir), task, iteration=1)


# --------------------------------------------------------------------------------------------------- CLI


def test_cli_writes_an_analysis_document(rand_model_dir, tmp_path):
    import typer
    from deltalens.cli.common import guard
    from deltalens.cli.diversity import diversity
    from typer.testing import CliRunner

    app = typer.Typer()
    app.command()(guard(diversity))
    out = tmp_path / "div.json"
    res = CliRunner().invoke(app, [str(rand_model_dir), "--task", "arith", "--members", "2", "--sigma", "0.01",
                                   "--prompts", "1", "--samples", "2", "--max-new-tokens", "4", "--label", "rnd",
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    validate(doc)  # the analysis.json contract
    assert doc["schema_version"] == 1 and doc["base"]["path"] == str(rand_model_dir)
    assert doc["models"][0]["label"] == "rnd" and set(doc["diversity"]) == {"rnd"}
    assert doc["diversity"]["rnd"]["members"] == 2
    bad = CliRunner().invoke(app, [str(rand_model_dir), "--temperature", "0", "--members", "2", "--prompts", "1"])
    assert bad.exit_code == 2 and "temperature" in bad.output


# ------------------------------------------------------------------------------------------ small-σ law


@pytest.mark.slow
def test_small_sigma_law_on_tiny():
    """Lemma 1 on the bundled tiny model (about 1 min): JS ∝ σ², and JS = (σ²/2)(1/N) Σ_i (ε_i-ε̄)ᵀ I (ε_i-ε̄)
    on the drawn noise, paired on the Fisher's own samples (within a few %) and from the members' own
    samples (within the heavy-tailed sampling error); against the expectation over ε, (σ²/2)(1-1/N) tr I,
    one draw of N = 8 scatters by tens of % (the benchmark averages draws)."""
    from deltalens.analysis.diversity import sigma_sweep
    from deltalens.io.models import load_model

    model, tok = load_model(tiny_spec())
    rows = sigma_sweep(model, tok, get_task("arith"), [3e-4, 1e-3], members=8, prompts=12, samples=4,
                       fisher_samples=32)
    for r in rows:
        assert abs(r["ratio_paired_draw"] - 1) < max(0.1, 3 * r["ratio_paired_draw_se"]), r
        assert 0.7 < r["js_mi_mean"] / r["js_pred_draw"] < 1.3, r
        assert 0.5 < r["ratio_mi"] < 1.5, r
    growth = rows[1]["js_mi_mean"] / rows[0]["js_mi_mean"]
    assert 0.75 * (1e-3 / 3e-4) ** 2 < growth < 1.25 * (1e-3 / 3e-4) ** 2


def test_js_succ_null_removes_the_sampling_bias_of_identical_members():
    """σ = 0 (identical members): the plug-in js_succ is positive from sampling alone; corrected ~ 0."""
    import random

    from deltalens.analysis.diversity import js_success_null

    rng = random.Random(0)
    n, m, p, trials = 8, 4, 0.4, 3000
    plug, corrected = [], []
    for _ in range(trials):
        succ = [sum(rng.random() < p for _ in range(m)) for _ in range(n)]
        rates = [s / m for s in succ]
        plug.append(js_success(rates))
        corrected.append(js_success(rates) - js_success_null(succ, m))
    se = (sum((c - sum(corrected) / trials) ** 2 for c in corrected) / (trials - 1)) ** 0.5 / trials ** 0.5
    assert sum(plug) / trials > 0.05  # the bias the issue measured (0.075 nats at M = 4)
    assert abs(sum(corrected) / trials) < 3 * se
    assert js_success_null([0] * 4, 4) == 0.0 and js_success_null([4] * 4, 4) == 0.0  # no spread possible
