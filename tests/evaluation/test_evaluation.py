"""Known answers for Pass@K / Maj@K, and an end-to-end evaluation on the bundled tiny model."""

import random
from math import comb

import pytest

from deltalens.evaluation import maj_at_k, maj_curve, pass_at_k, summarize
from deltalens.schema import validate
from deltalens.tasks import ArithTask, Problem


def brute_pass(n, c, k):
    return 1 - comb(n - c, k) / comb(n, k)


@pytest.mark.parametrize("n,c,k", [(32, 0, 1), (32, 1, 1), (32, 5, 16), (32, 20, 16), (32, 17, 16), (32, 16, 16),
                                   (10, 3, 10), (100, 1, 50), (5, 5, 1), (7, 2, 6)])
def test_pass_at_k_matches_combinatorial_formula(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass(n, c, k), abs=1e-12)


def test_pass_at_k_edge_cases():
    assert pass_at_k(32, 17, 16) == 1.0  # n - c < k: every k-subset contains a correct sample
    assert pass_at_k(32, 0, 32) == 0.0
    assert pass_at_k(32, 8, 1) == pytest.approx(0.25)
    # stable for large n where binomials overflow floats
    assert 0 < pass_at_k(2000, 3, 1000) < 1
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_maj_at_k_known_answers():
    ans = ["5", "5", "7", None]
    ok = [True, True, False, False]
    assert maj_at_k(ans, ok, 4) == 1.0  # 5 has 2 votes
    assert maj_at_k(ans, ok, 1) == 0.5
    # a tie between a right and a wrong answer counts half
    assert maj_at_k(["1", "2"], [True, False], 2) == 0.5
    assert maj_at_k([None, None], [False, False], 2) == 0.0
    # k=2 of ["5","5","7",None]: exact expectation by enumeration of the 6 pairs
    pairs = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    vals = [1, 0.5, 1, 0.5, 1, 0]
    assert maj_at_k(ans, ok, 2, subsets=20000, seed=1) == pytest.approx(sum(vals) / len(pairs), abs=0.02)


def test_maj_curve_agrees_with_scalar_estimator():
    rng = random.Random(0)
    ans = [rng.choice(["1", "2", "3", None]) for _ in range(16)]
    ok = [a == "2" for a in ans]
    curve = maj_curve(ans, ok, subsets=4000, seed=3)
    for k in (1, 3, 8, 16):
        assert curve[k - 1] == pytest.approx(maj_at_k(ans, ok, k, subsets=4000, seed=5), abs=0.03)


def test_summarize_counts_correct_samples():
    task = ArithTask()
    probs = [Problem("Q: 1+2=?\nA:", "3"), Problem("Q: 5-1=?\nA:", "4")]
    comps = [[" 1+2=3.\n#### 3", " 1+2=4.\n#### 4", "garbage", " #### 3"],
             [" 5-1=4.\n#### 4", " #### 3", " #### 3", "#### 3"]]
    out = summarize(task, probs, comps, ks=[1, 4])
    assert out["per_problem"][0]["correct"] == 2 and out["per_problem"][1]["correct"] == 1
    assert out["pass_at_k"]["1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert out["pass_at_k"]["4"] == 1.0
    assert out["maj_at_k"]["4"] == pytest.approx((1.0 + 0.0) / 2)  # p1: "3" wins (2 votes); p2: wrong "3" wins
    # rewards: 1, 0.1, 0, 1 | 1, 0.1, 0.1, 0.1
    assert out["mean_reward"] == pytest.approx((2.1 + 1.3) / 8)


def test_cli_eval_tiny_end_to_end_and_seeded(tmp_path):
    import json

    from deltalens.cli.main import app
    from typer.testing import CliRunner

    outs = []
    for i in range(2):
        f = tmp_path / f"e{i}.json"
        r = CliRunner().invoke(app, ["eval", "tiny", "--limit", "8", "--samples", "4", "--k", "1,4", "--json", str(f)])
        assert r.exit_code == 0, r.output
        assert "Pass@1" in r.output and "Maj@4" in r.output
        assert "Maj@1" not in r.output  # Maj@1 is Pass@1: not a column of its own
        outs.append(json.loads(f.read_text()))
        validate(outs[-1])  # the analysis.json contract
    a, b = outs
    assert a["schema_version"] == 1 and set(a["evals"]) == {"tiny"}
    ev = a["evals"]["tiny"]
    assert ev["n_problems"] == 8 and ev["samples"] == 4 and len(ev["curve"]["pass"]) == 4
    assert 0 < ev["pass_at_k"]["4"] <= 1 and ev["pass_at_k"]["1"] <= ev["pass_at_k"]["4"]
    from deltalens.generation.dtype import machine

    assert ev["timing"]["machine"] == machine("cpu") and ev["timing"]["machine"].startswith("cpu: ")
    # seeded: identical results run to run
    assert [p["correct"] for p in a["evals"]["tiny"]["per_problem"]] == \
        [p["correct"] for p in b["evals"]["tiny"]["per_problem"]]


def test_generation_greedy_is_deterministic_and_stops_at_eos(rand_model_dir):
    from deltalens.generation import HFBackend, SamplingParams
    from deltalens.io.models import load_model

    model, tok = load_model(str(rand_model_dir))
    be = HFBackend(model, tok, max_batch=3)  # several batches, mixed prompt lengths (left padding)
    prompts = ["Q: 1+2=?\nA:", "Q: 10+20+30=?\nA:", "x", "Q: 5=?\nA:"]
    g1 = be.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=12))
    g2 = be.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=12))
    assert g1 == g2 and all(c[0] == c[1] for c in g1)
    # each prompt alone (no padding) gives the same greedy completion as in the padded batch
    for p, comps in zip(prompts, g1):
        assert HFBackend(model, tok).generate([p], SamplingParams(n=1, temperature=0, max_new_tokens=12))[0][0] == comps[0]
    s1 = be.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=5))
    s2 = be.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=5))
    assert s1 == s2
    assert all("<eos>" not in c and "<pad>" not in c for cs in s1 for c in cs)
