"""Pass@K / Maj@K evaluation: the estimators (`passk`) and sampling + scoring of models (`evaluate`)."""

from deltalens.evaluation.evaluate import evaluate, evaluate_models, evaluate_state_dict
from deltalens.evaluation.passk import maj_at_k, maj_curve, parse_ks, pass_at_k, summarize

__all__ = ["evaluate", "evaluate_models", "evaluate_state_dict", "maj_at_k", "maj_curve", "parse_ks",
           "pass_at_k", "summarize"]
