"""FLOP-matched budgets: unit arithmetic, budget -> iterations/steps, splitting, parsing."""

from __future__ import annotations

import pytest

from deltalens.errors import DeltalensError
from deltalens.training.budget import (
    es_token_units_per_iteration,
    es_units,
    grpo_token_units_per_step,
    grpo_units,
    grpo_units_per_response,
    iterations_for_budget,
    parse_budget,
    split_budget,
    steps_for_budget,
)


def test_units_per_prompt_match_at_n_equals_4g():
    # ES 2N per prompt, GRPO 8G per prompt: N = 4G costs the same (the paper's N = 32 vs G = 8)
    assert es_units(1, 1, 32) == 64 == grpo_units(1, 1, 8)
    assert es_units(10, 64, 32) == grpo_units(10, 64, 8) == 10 * 64 * 64
    assert es_units(3, 5, 4) == 3 * 5 * 2 * 4
    assert grpo_units(3, 5, 4) == 3 * 5 * 8 * 4
    assert grpo_units(3, 5, 4, reference=True) == 3 * 5 * 10 * 4
    assert es_units(0, 64, 32) == grpo_units(0, 64, 8) == 0


def test_budget_to_iterations_and_steps_round_down():
    assert iterations_for_budget(64 * 64 * 100, 64, 32) == 100
    assert steps_for_budget(64 * 64 * 100, 64, 8) == 100
    assert iterations_for_budget(64 * 64 * 100 + 4095, 64, 32) == 100  # never over budget
    assert steps_for_budget(1000, 2, 4) == 1000 // 64
    # a run spends at most its budget, and one more iteration/step would exceed it
    for b in (1000, 12345, 10**6):
        it, st = iterations_for_budget(b, 8, 4), steps_for_budget(b, 8, 4)
        assert es_units(it, 8, 4) <= b < es_units(it + 1, 8, 4)
        assert grpo_units(st, 8, 4) <= b < grpo_units(st + 1, 8, 4)


def test_matched_budget_gives_matched_runs():
    b = 2e6
    it = iterations_for_budget(b, 64, 32)
    st = steps_for_budget(b, 64, 8)
    assert it == st  # N = 4G: equal iterations and steps for equal prompts
    assert es_units(it, 64, 32) == grpo_units(st, 64, 8)


def test_budget_errors_say_what_to_change():
    with pytest.raises(DeltalensError, match="below one ES iteration"):
        iterations_for_budget(10, 64, 32)
    with pytest.raises(DeltalensError, match="below one GRPO step"):
        steps_for_budget(10, 64, 8)
    with pytest.raises(DeltalensError, match="positive"):
        iterations_for_budget(-5, 1, 2)
    with pytest.raises(DeltalensError, match="population"):
        es_units(1, 1, 0)
    with pytest.raises(DeltalensError, match="steps"):
        grpo_units(-1, 1, 2)


def test_split_budget():
    assert split_budget(1000) == [500, 500]
    assert split_budget("1k", [0.25, 0.75]) == [250, 750]
    with pytest.raises(DeltalensError, match="sum to 1"):
        split_budget(1000, [0.5, 0.6])


def test_parse_budget():
    assert parse_budget("2e6") == 2e6
    assert parse_budget("1.5M") == 1.5e6
    assert parse_budget("300k") == 3e5
    assert parse_budget("4096") == 4096
    assert parse_budget(10) == 10
    assert iterations_for_budget("1M", 64, 32) == 10**6 // 4096
    with pytest.raises(DeltalensError, match="--budget"):
        parse_budget("lots")


def test_measured_cost_counts_tokens_and_the_reference_pass():
    # per completion token: generation 2 + forward 2 + backward 4, + the reference forward 2 when beta > 0
    assert grpo_units_per_response(0.0) == 8 and grpo_units_per_response(1e-3) == 10
    # mu = 2: two policy passes (6 each) + one forward for the old policy's log-probs (2) + generation (2)
    assert grpo_units_per_response(0.0, 2) == 2 + 12 + 2 and grpo_units_per_response(0.04, 2) == 18
    # P = 4 prompts x G = 8 completions of 30 tokens: 32 x 30 tokens x 10 passes
    assert grpo_token_units_per_step(4, 8, 30.0, beta=1e-3) == 32 * 30 * 10
    assert grpo_token_units_per_step(4, 8, 30.0) == 32 * 30 * 8
    # ES: N = 16 members x P = 16 prompts, 25 tokens each, generated once
    assert es_token_units_per_iteration(16, 16, 25.0) == 256 * 25 * 2
    # at equal lengths and the matched budget (N = 4G, same prompts) the reference pass is GRPO's +25%
    L = 12.5
    es, grpo = es_token_units_per_iteration(64, 32, L), grpo_token_units_per_step(64, 8, L, beta=1e-3)
    assert grpo / es == 1.25 and grpo_token_units_per_step(64, 8, L) == es
    assert es_token_units_per_iteration(1, 2, 0) == 0.0  # an empty response costs no token passes


def test_measured_cost_refuses_bad_values():
    with pytest.raises(DeltalensError, match="completion_tokens"):
        es_token_units_per_iteration(1, 2, -1.0)
    with pytest.raises(DeltalensError, match="completion_tokens"):
        grpo_token_units_per_step(1, 2, float("nan"))
    with pytest.raises(DeltalensError, match="beta"):
        grpo_units_per_response(-0.1)
    with pytest.raises(DeltalensError, match="num_iterations"):
        grpo_units_per_response(0.0, 0)
