"""Token entropy of a policy along its own samples: does fine-tuning collapse the next-token distribution?

For each problem x, `samples` responses y ~ π_T(·|x) are drawn (the same sampler and scorer as the
diversity analysis: token ids, never re-tokenised text), and along each response the entropy of the
next-token distribution softmax(logits / T) is summed over the response positions (EOS included). The
per-problem value is the token-weighted mean, H(x) = Σ_y Σ_t H_t / Σ_y |y|, in nats per token. Paired
per-problem values of a model and its base feed `deltalens.analysis.stats.paired_effect` (arXiv
2608.27351: GRPO sharpens the policy, ES does not).
"""

from __future__ import annotations

import torch

from deltalens.analysis.diversity.sampling import _seed, problem_ids, sample_responses, sequence_logprobs


@torch.no_grad()
def token_entropy(model, tok, problems, *, samples: int = 4, temperature: float = 0.6,
                  max_new_tokens: int = 64, seed: int = 0, chat_template: str = "auto",
                  progress=None) -> list[float]:
    """Per problem: the mean next-token entropy (nats) at `temperature` along `samples` own samples.

    progress(done): sequences sampled, then scored, out of 2 x problems x samples."""
    prompt_ids = problem_ids(tok, problems, chat_template)
    n = len(problems) * samples
    resp = sample_responses(model, tok, prompt_ids, samples, temperature=temperature, max_new_tokens=max_new_tokens,
                            seed=_seed(seed, "entropy"), progress=progress)
    items = [(p, y) for p in range(len(problems)) for y in resp[p]]
    sc = sequence_logprobs(model, prompt_ids, items, temperature, entropy=True,
                           progress=None if progress is None else (lambda k: progress(n + k)))
    ent, tokens = sc["entropy"].view(len(problems), samples), sc["tokens"].view(len(problems), samples)
    return (ent.sum(1) / tokens.sum(1).clamp(min=1)).tolist()
