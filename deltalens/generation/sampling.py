"""Drawing the next token from softmax(logits / T) without one random number per vocabulary entry.

transformers' `generate(do_sample=True)` ends each step with `torch.multinomial(probs, 1)`, which on the
CPU draws an exponential variate for every (row, vocabulary entry): for SmolLM2's 49,152-token vocabulary at
64 rows, 3.1M variates a step, more time than the model's matmuls at that batch (measured:
benchmarks/README.md, "On AMX-BF16"). We draw by inverse CDF instead, one uniform per row, in two levels:

1. p = exp((scores - max) / T) (fp32, [rows, V]), unnormalised, computed in place in the scores (0 where
   it would be below e^-87, under fp32's normal range);
2. each block of BLOCK entries' total (the last block may be partial), the totals' running sums in fp64;
3. u ~ U[0, total) per row: the block whose fp64 interval holds u, then, from that block's running sums
   (fp32; the only running sums computed), the entry whose interval holds the rest (searchsorted,
   right-closed: an entry of probability 0 is never taken).

The draw is exact up to the fp32 rounding of the running sums inside a block (each entry's probability
off by at most BLOCK units in the last place of its block's mass, ~1.5e-5 of it at worst); the random
stream differs from `torch.multinomial`'s, so seeded samples differ from those of earlier versions while
their distribution does not (checked: tests/generation/test_sampling.py). Working in place matters as much
as the single uniform: a step that allocates and passes over [rows, V] tensors several times
(temperature, the draw, the output) cost ~3x this one (measured: benchmarks/bench_sampler.py).

Our decoding loop (`generation.decode`) calls `draw` on each step's logits. `sampling_kwargs` wires the same
draw into transformers' `generate` (for a model whose generation_config `decode` does not reproduce): greedy selection (`do_sample=False`) over logits processors:
the draw with the temperature inside it, or, with top-p, temperature and top-p first and then the draw.
The draw leaves 0 at the drawn token and -inf elsewhere, so the argmax is the sample. Greedy decoding
(T = 0) is untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 256  # vocabulary entries per block of the two-level draw


def inverse_cdf_draw_(scores: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[rows] token ids, each drawn from softmax(scores[row] / temperature) with the global torch generator,
    computed in place: `scores` ([rows, V], fp32, contiguous) is left holding
    exp((scores - max) / temperature), unnormalised (the draw scales u by each row's total instead)."""
    rows, vocab = scores.shape
    m = scores.amax(-1, keepdim=True)
    # unnormalised probabilities, in place; below e^-87 of the row's largest (under fp32's normal range)
    # they are made 0 first: exp is ~10x slower on such arguments than on -inf (measured: bench_sampler.py)
    p = F.threshold_(scores.sub_(m).mul_(1.0 / temperature), -87.0, float("-inf")).exp_()
    full, rem = divmod(vocab, BLOCK)
    # each block's total (fp32): not running sums over the whole vocabulary (the draw 11.0 against 23.1 ms at
    # [214, 49,152], benchmarks/bench_decode_pieces.py; a sum and a cumsum may round a block's total an ulp
    # apart, which `rest` below absorbs)
    totals = [p[:, : full * BLOCK].view(rows, full, BLOCK).sum(-1)]
    if rem:  # the last, partial block (rem entries)
        totals.append(p[:, full * BLOCK:].sum(-1, keepdim=True))
    outer = torch.cat(totals, 1).double().cumsum_(-1)  # [rows, blocks]: running block totals
    blocks = outer.shape[1]
    u = torch.rand(rows, 1, dtype=torch.float64, device=p.device) * outer[:, -1:]
    b = torch.searchsorted(outer, u, right=True).clamp_(max=blocks - 1)  # [rows, 1]
    before = torch.where(b > 0, outer.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(u))
    # the drawn block's running sums only ([rows, BLOCK]); a partial block padded with zeros (its running
    # sum stays at its total there, never drawn: `rest` stays below it)
    cols = b * BLOCK + torch.arange(BLOCK, device=p.device)
    within = p.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, 0.0).cumsum_(-1).double()
    # the rest of u inside the block, kept below its last running sum (fp64 vs fp32 sums may differ by an ulp)
    rest = torch.minimum(u - before, within[:, -1:] * (1 - 2.0**-40))
    return (b * BLOCK + torch.searchsorted(within, rest, right=True)).squeeze(1)


def inverse_cdf_draw(scores: torch.Tensor) -> torch.Tensor:
    """[rows] token ids, each drawn from softmax(scores[row]) (scores [rows, V], any float dtype, left as
    it is) with the global torch generator."""
    return draw(scores, 1.0)


def draw(logits: torch.Tensor, temperature: float, top_p: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """[rows] token ids drawn from softmax(logits / temperature) ([rows, V], any float dtype, left as it is),
    top-p first where top_p < 1: the numbers `sampling_kwargs`'s processors compute inside `generate` (its
    fp32 copy of the logits, then temperature and top-p, then the draw), without the [rows, V] one-hot they
    hand back for `generate`'s argmax (`generation.decode`). `out`: a contiguous fp32 [rows, V] tensor to
    copy the logits into (overwritten), so that a decoding loop reuses one buffer: at SmolLM2's eval batch
    a fresh fp32 copy is 42 MB, above glibc's largest mmap threshold (32 MiB), so each step's would be
    mapped and faulted in anew."""
    if out is not None:
        scores = out.copy_(logits)
    else:
        scores = logits.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
    if top_p >= 1:
        return inverse_cdf_draw_(scores, temperature)
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    scores = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, scores))
    return inverse_cdf_draw_(scores.contiguous(), 1.0)


class InverseCDFSampler:
    """A transformers logits processor: 0 at a token drawn from softmax(scores / temperature), -inf
    elsewhere. It writes into the scores it is given (fp32): `generate` hands the processors its own copy
    of the last position's logits (which it would also return with output_logits=True, so we never ask
    for them), and each earlier processor here (temperature, top-p) returns a new tensor."""

    def __init__(self, temperature: float = 1.0):
        self.temperature = temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.dtype != torch.float32 or not scores.is_contiguous():
            scores = scores.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
        ids = inverse_cdf_draw_(scores, self.temperature)
        return scores.fill_(float("-inf")).scatter_(1, ids.unsqueeze(1), 0.0)


def sampling_kwargs(temperature: float, top_p: float = 1.0) -> dict:
    """transformers `generate` arguments: sampling from softmax(logits / T), top-p when top_p < 1 (top-k
    off), through `InverseCDFSampler`; greedy when temperature is 0."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    off = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    if temperature <= 0:
        return off
    if top_p >= 1:  # the temperature applied inside the draw: no [rows, V] tensor beside generate's own
        return {**off, "logits_processor": LogitsProcessorList([InverseCDFSampler(temperature)])}
    procs = [TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p), InverseCDFSampler()]
    return {**off, "logits_processor": LogitsProcessorList(procs)}
