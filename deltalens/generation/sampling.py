"""Drawing the next token from softmax(logits / T) without one random number per vocabulary entry.

transformers' `generate(do_sample=True)` ends each step with `torch.multinomial(probs, 1)`, which on the
CPU draws an exponential variate for every (row, vocabulary entry): for SmolLM2's 49,152-token vocabulary at
64 rows, 3.1M variates a step, more time than the model's matmuls at that batch (measured:
benchmarks/README.md, "On AMX-BF16"). We draw by inverse CDF instead, one uniform per row, in two levels:

1. probs = softmax(scores) (fp32, [rows, V]), padded to a multiple of BLOCK and viewed [rows, V / BLOCK, BLOCK];
2. running sums inside each block (fp32, BLOCK terms), the blocks' totals summed across in fp64;
3. u ~ U[0, 1) per row: the block whose fp64 interval holds u x total, then the entry of that block whose
   running-sum interval holds the rest (searchsorted, right-closed: an entry of probability 0 is never taken).

The draw is exact up to the fp32 rounding of the running sums
inside a block (each entry's probability off by at most BLOCK units in the last place of its block's mass,
~1.5e-5 of it at worst); the random stream differs from `torch.multinomial`'s, so seeded samples differ
from those of earlier versions while their distribution does not (checked: tests/generation/test_sampling.py).

`sampling_kwargs` wires it into `generate`: greedy selection (`do_sample=False`) over logits processors
that apply the temperature, top-p where asked, and then this draw, which leaves 0 at the drawn token and
-inf elsewhere, so the argmax is the sample. Greedy decoding (T = 0) is untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 256  # vocabulary entries per block of the two-level draw


def inverse_cdf_draw(scores: torch.Tensor) -> torch.Tensor:
    """[rows] token ids, each drawn from softmax(scores[row]) (scores [rows, V], any float dtype) with the
    global torch generator."""
    p = torch.softmax(scores.float(), dim=-1)
    rows, vocab = p.shape
    blocks = -(-vocab // BLOCK)
    if blocks * BLOCK != vocab:
        p = F.pad(p, (0, blocks * BLOCK - vocab))
    inner = p.view(rows, blocks, BLOCK).cumsum(-1)  # running sums inside each block
    outer = inner[:, :, -1].double().cumsum(-1)  # [rows, blocks]: running block totals
    u = torch.rand(rows, 1, dtype=torch.float64, device=p.device) * outer[:, -1:]
    b = torch.searchsorted(outer, u, right=True).clamp_(max=blocks - 1)  # [rows, 1]
    before = torch.where(b > 0, outer.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(u))
    within = inner.gather(1, b.unsqueeze(-1).expand(rows, 1, BLOCK)).squeeze(1).double()  # [rows, BLOCK]
    # the rest of u inside the block, kept below its last running sum (fp64 vs fp32 sums may differ by an ulp)
    rest = torch.minimum(u - before, within[:, -1:] * (1 - 2.0**-40))
    return (b * BLOCK + torch.searchsorted(within, rest, right=True)).squeeze(1)


class InverseCDFSampler:
    """A transformers logits processor: 0 at a token drawn from softmax(scores), -inf elsewhere."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = inverse_cdf_draw(scores)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, ids.unsqueeze(1), 0.0)


def sampling_kwargs(temperature: float, top_p: float = 1.0) -> dict:
    """transformers `generate` arguments: sampling from softmax(logits / T), top-p when top_p < 1 (top-k
    off), through `InverseCDFSampler`; greedy when temperature is 0."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    off = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    if temperature <= 0:
        return off
    procs = [TemperatureLogitsWarper(temperature)]
    if top_p < 1:
        procs.append(TopPLogitsWarper(top_p))
    return {**off, "logits_processor": LogitsProcessorList([*procs, InverseCDFSampler()])}
