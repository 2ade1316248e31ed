"""What each run of a study actually spent, beside the FLOP-matched budget it was given (issue #34, item 8).

The budget (`deltalens.training.budget`) counts units of "the model's parameters over one response's
tokens": ES 2 per response, GRPO 8 per response, and leaves out GRPO's KL reference forward pass (+2 per
response when beta > 0) and how long the responses actually were. `run_flops` measures, per run, from its
config.json and metrics.jsonl:

    nominal_units      units the budget accounting charges (the run's last `units` row, else steps x P x 8G
                       or iterations x P x 2N)
    reference_units    GRPO with beta > 0: the reference model's forward pass, 2 per response (0 for ES)
    completion_tokens  mean response length in tokens over the run (GRPO's `completion_length` rows); None
                       where not recorded (ES rows do not record lengths)
    token_units        (nominal + reference) x completion_tokens: parameter-token passes, comparable across
                       methods only when both lengths are known

so "FLOP-matched" is a stated, measured statement, and what is missing is named (`missing`).
"""

from __future__ import annotations

from deltalens.errors import DeltalensError
from deltalens.io.runs import RunDir
from deltalens.training.budget import REFERENCE_UNITS_PER_RESPONSE, es_units, grpo_units


def run_flops(run_dir, method: str) -> dict:
    """The measured cost of one run (module docstring); a chain's stages are summed by method."""
    run = RunDir(run_dir)
    try:
        cfg = run.config()
    except DeltalensError:
        cfg = {}
    trained = [r for r in run.metrics() if r.get("iteration", 0) > 0 and "reward_mean" in r]  # training rows
    units = [r["units"] for r in trained if isinstance(r.get("units"), (int, float))]
    out = {"method": method, "nominal_units": None, "reference_units": 0.0, "completion_tokens": None,
           "token_units": None, "missing": []}
    if method == "es" and cfg:
        try:
            out["nominal_units"] = float(es_units(len(trained), cfg["prompts_per_iteration"], cfg["population"]))
        except (DeltalensError, KeyError):
            pass
        out["missing"].append("completion lengths (ES metrics rows do not record them)")
    elif method == "grpo" and cfg:
        try:
            out["nominal_units"] = float(units[-1]) if units else float(
                grpo_units(len(trained), cfg["prompts_per_step"], cfg["num_generations"]))
            if cfg.get("beta", 0) > 0:
                responses = len(trained) * cfg["prompts_per_step"] * cfg["num_generations"]
                out["reference_units"] = float(REFERENCE_UNITS_PER_RESPONSE * responses)
        except (DeltalensError, KeyError):
            pass
        lengths = [r["completion_length"] for r in trained if isinstance(r.get("completion_length"), (int, float))]
        if lengths:
            out["completion_tokens"] = sum(lengths) / len(lengths)
        else:
            out["missing"].append("completion lengths (no completion_length rows)")
    else:
        out["missing"].append("a chain's stages are not split here (see each stage's directory)")
    if out["nominal_units"] is not None and out["completion_tokens"] is not None:
        out["token_units"] = (out["nominal_units"] + out["reference_units"]) * out["completion_tokens"]
    return out
