"""FLOP-matched budgets: express ES and GRPO runs in one compute unit so they compare fairly.

The unit is one pass of the model's parameters over one response's tokens, i.e. roughly
`params x response tokens` FLOPs (a forward pass costs ~2 such units: one multiply + one add per
parameter per token; a backward pass ~2x a forward, 4 units). Per training prompt:

    ES    N responses (one per population member), each generated once:        2·N units
    GRPO  G responses, generated (2) + re-scored with gradients: forward (2)
          + backward (4):                                                      8·G units

so ES with N = 4·G members costs the same per prompt as GRPO with group size G (the paper's N = 32
vs G = 8). A whole run:

    es_units(iterations, P, N) = iterations · P · 2N
    grpo_units(steps, P, G)    = steps · P · 8G

Not counted in the charge (as in arXiv 2608.27351's accounting): ES's noise generation and in-place
perturbation (O(params) per member, no tokens), GRPO's optimizer step (O(params)), the KL reference
model's forward pass (+2G per prompt when beta > 0; pass `reference=True` to count it), extra policy
passes for `num_iterations` (μ) > 1, and the prompt tokens themselves. Both methods are assumed to
produce responses of similar length; the unit scales with response length, so compare runs on one task.

Measured cost (`grpo_token_units_per_step`, `es_token_units_per_iteration`): what a step or iteration
spent given the responses it actually produced, in *token units*, one pass of the parameters over one
token (~params FLOPs; a forward pass over one token is 2 of them, a backward pass 4), so FLOPs ≈ token
units x params. Per response of L completion tokens (L: the step's or iteration's mean length):

    ES    generation                                                    2L
    GRPO  generation 2L + per policy pass over the completion (forward 2L + backward 4L), μ of them,
          + the old policy's log-probs when μ > 1 (one forward, 2L)
          + the KL reference model's forward pass when β > 0 (2L)      (8 + 2)L at the paper's μ = 1, β > 0

so at equal lengths GRPO's reference pass adds 2/8 = 25% to what the budget charged it, and a method whose
responses run longer spends proportionally more. Still not counted: prompt tokens (prefill and the
forward passes over the prompt), and GRPO's generation re-reading the KV cache (attention, O(L²) per
response: small against params x L for these lengths).

`--budget B` on the command line gives a run B units: `iterations_for_budget` / `steps_for_budget`
turn it into ES iterations / GRPO steps (rounded down, so a run never exceeds its budget), and a
sequence (ES->GRPO) splits B between its stages (`split_budget`, half/half by default).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from deltalens.errors import DeltalensError

ES_UNITS_PER_RESPONSE = 2  # one generation (forward) per member response
GRPO_UNITS_PER_RESPONSE = 8  # generation (2) + forward (2) + backward (4) per sampled response
REFERENCE_UNITS_PER_RESPONSE = 2  # KL reference forward pass (beta > 0), only with reference=True
GENERATION_UNITS = 2  # measured: sampling a response, per token (one forward pass with the KV cache)
POLICY_PASS_UNITS = 6  # measured: one GRPO policy pass over a completion, per token (forward 2 + backward 4)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DeltalensError(f"{name} must be a positive integer (got {value!r})")
    return value


def es_units_per_iteration(prompts: int, population: int) -> int:
    """Units of one ES iteration: every member answers every prompt once (2 units per response)."""
    return ES_UNITS_PER_RESPONSE * _positive_int("population", population) * _positive_int("prompts", prompts)


def grpo_units_per_step(prompts: int, num_generations: int, reference: bool = False) -> int:
    """Units of one GRPO step: G responses per prompt, generated and back-propagated (8 units each)."""
    per = GRPO_UNITS_PER_RESPONSE + (REFERENCE_UNITS_PER_RESPONSE if reference else 0)
    return per * _positive_int("num_generations", num_generations) * _positive_int("prompts", prompts)


def _length(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise DeltalensError(f"completion_tokens must be a number >= 0 (got {value!r})")
    return float(value)


def grpo_units_per_response(beta: float = 0.0, num_iterations: int = 1) -> int:
    """Measured passes per completion token of one GRPO response, in units (module docstring): generation 2,
    μ policy passes of forward 2 + backward 4, the old policy's log-probs 2 when μ > 1, the reference 2 when
    β > 0. 10 at the paper's settings (μ = 1, β = 1e-3), 8 with β = 0 (what the budget charges)."""
    mu = _positive_int("num_iterations", num_iterations)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise DeltalensError(f"beta must be a number >= 0 (got {beta!r})")
    return (GENERATION_UNITS + POLICY_PASS_UNITS * mu + (GENERATION_UNITS if mu > 1 else 0)
            + (REFERENCE_UNITS_PER_RESPONSE if beta > 0 else 0))


def grpo_token_units_per_step(prompts: int, num_generations: int, completion_tokens: float, *,
                              beta: float = 0.0, num_iterations: int = 1) -> float:
    """Token units one GRPO step spent: P·G responses of mean length L, `grpo_units_per_response` passes per
    token each (P·G·10·L at the paper's μ = 1, β > 0)."""
    n = _positive_int("prompts", prompts) * _positive_int("num_generations", num_generations)
    return float(grpo_units_per_response(beta, num_iterations) * n) * _length(completion_tokens)


def es_token_units_per_iteration(prompts: int, population: int, completion_tokens: float) -> float:
    """Token units one ES iteration spent: N·P responses of mean length L, generated once (2 per token)."""
    n = _positive_int("prompts", prompts) * _positive_int("population", population)
    return float(GENERATION_UNITS * n) * _length(completion_tokens)


def es_units(iterations: int, prompts: int, N: int) -> int:
    """Compute units of `iterations` ES iterations with P = `prompts` prompts and population N: it·P·2N."""
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise DeltalensError(f"iterations must be an integer >= 0 (got {iterations!r})")
    return iterations * es_units_per_iteration(prompts, N)


def grpo_units(steps: int, prompts: int, G: int, reference: bool = False) -> int:
    """Compute units of `steps` GRPO steps with P = `prompts` prompts and group size G: steps·P·8G
    (steps·P·10G with `reference=True`, counting the KL reference model's forward pass)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise DeltalensError(f"steps must be an integer >= 0 (got {steps!r})")
    return steps * grpo_units_per_step(prompts, G, reference)


def _budget_value(budget) -> float:
    b = parse_budget(budget) if isinstance(budget, str) else budget
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
        raise DeltalensError(f"budget must be a positive number of units (got {budget!r})")
    return b


def iterations_for_budget(budget: float | str, prompts: int, N: int) -> int:
    """The most ES iterations (P prompts, population N) that fit in `budget` units; at least 1.

    Raises when not even one iteration fits, saying how many units one iteration needs.
    """
    b = _budget_value(budget)
    per = es_units_per_iteration(prompts, N)
    n = int(b // per)
    if n < 1:
        raise DeltalensError(f"budget {b:g} is below one ES iteration ({per} units for {prompts} prompts x "
                             f"population {N}); raise --budget or lower --prompts/--population")
    return n


def steps_for_budget(budget: float | str, prompts: int, G: int, reference: bool = False) -> int:
    """The most GRPO steps (P prompts, group size G) that fit in `budget` units; at least 1."""
    b = _budget_value(budget)
    per = grpo_units_per_step(prompts, G, reference)
    n = int(b // per)
    if n < 1:
        raise DeltalensError(f"budget {b:g} is below one GRPO step ({per} units for {prompts} prompts x "
                             f"{G} generations); raise --budget or lower --prompts/--num-generations")
    return n


def split_budget(budget: float | str, fractions: Sequence[float] = (0.5, 0.5)) -> list[float]:
    """Split a budget between the stages of a sequence (fractions must be > 0 and sum to 1)."""
    b = _budget_value(budget)
    fr = [float(f) for f in fractions]
    if not fr or any(not (f > 0) for f in fr) or abs(sum(fr) - 1.0) > 1e-9:
        raise DeltalensError(f"budget fractions must be positive and sum to 1 (got {list(fractions)})")
    return [b * f for f in fr]


_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgbt]?)\s*$", re.IGNORECASE)


def parse_budget(text: str | float) -> float:
    """'2e6', '1.5M', '300k', 4096 -> units (float). Suffixes k, M, G/B, T (powers of 1000)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return _budget_value(text)
    m = _BUDGET_RE.match(str(text))
    if not m:
        raise DeltalensError(f"--budget must be a number of units like 2e6, 1.5M or 300k (got {text!r})")
    return _budget_value(float(m.group(1)) * _SUFFIX[m.group(2).lower()])
