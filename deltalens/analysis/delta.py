"""Weight deltas: how far, where, and how a fine-tuned checkpoint moved from its base.

Implements the weight-change analysis of arXiv 2608.27351 (ES vs GRPO; building on Qiu et al.,
arXiv 2509.24372): for Δ = θ - θ0, per tensor

    l2 = ||Δ||₂   base_l2 = ||θ0||₂   rel_l2 = ||Δ||₂/||θ0||₂   max_abs = max|Δ|   mean_abs = mean|Δ|
    frac_changed   = share of coordinates with Δ != 0 exactly (bit-level change)
    frac_above_tol = share with |Δ| > tol

aggregated per parameter group, per (layer, group) and for the whole model. Aggregates are built from
sums (Σ Δ², Σ θ0², Σ|Δ|, counts), never by averaging per-tensor norms; the whole-model rel_l2 is the
paper's ||θ-θ0|| / ||θ0||. It also lists the top-k coordinates by |Δ| and by |Δ|/|θ0| with their group
composition, and the ratio of rel_l2 between checkpoints (the paper's "ES moves the weights ~N times
more than GRPO").

Memory and speed: two TensorSources are streamed. Safetensors tensors are read in PIECE-sized ranges
(8 MB per side in float32) by a background thread into one reused 64 MB arena, while the main thread
reduces the previous pieces in CHUNK-sized float32 steps (1 MB, cache-resident) with preallocated
buffers, so reading and computing overlap and peak memory is the arena + a few MB, whatever the model
size (~310 MB RSS with torch's own ~225 MB for a 1.5B pair). Formats that only read whole tensors
(GGUF, .pt) are read a tensor pair at a time, ~2.5x the largest tensor. benchmarks/bench_diff.py
measures a diff against reading both files once.

Departures / choices (not in the paper):
- Non-finite coordinates (NaN/Inf in either checkpoint) are excluded from every metric and reported in
  `warnings` with counts; they are never averaged in.
- The relative top-k ranks |Δ|/|θ0| over coordinates with θ0 != 0 and Δ != 0 (the ratio is infinite
  where θ0 = 0; how many changed coordinates that excludes is reported in `warnings`). Both top-k lists
  contain changed coordinates only, so they can be shorter than k.
- Tied tensors (embedding == lm_head) are one parameter: counted once, under the first name.
- Group names: fused qkv projections (GPT-2 c_attn, query_key_value, qkv_proj) cannot be split into
  q/k/v without architecture knowledge and go to the extra group `attn_qkv`; attention biases (q/k/v/o,
  fused or not) go to `attn_bias`; MLP biases (GPT-2) stay with their projection (mlp_up/mlp_down);
  position embeddings (GPT-2 wpe) count as `embed`; fused gate_up projections and anything unknown
  (buffers, MoE routers, vision towers) are `other`.
- Optional (`svd=N`, off by default): per 2-D tensor the top N singular values of ΔW and its
  effective rank exp(H(σ/Σσ)) (Roy & Vetterli 2007), stored as an extra `svd` field of the tensor
  entry.
- Norm weights of an architecture whose RMSNorm scales by 1 + w (Gemma: `ONE_PLUS_W_NORMS`) are taken as
  stored (w, as transformers holds them; a GGUF's 1 + w is read back as w); the diff entry's
  `norm_convention` gives the norm group's rel_l2 against the acting scale 1 + w beside it.
- A diff needs no architecture, but a bare weights file (.pt, a lone .safetensors) carries no config.json,
  so whether its embedding and lm_head are one tied parameter (an HF file that omits lm_head.weight)
  is unknown from the file; `arch=` (the command's `--arch`) lends such files its config.json.
"""

from __future__ import annotations

import contextlib
import gc
import math
import queue
import re
import threading
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deltalens.analysis.document import analysis_document, model_entry
from deltalens.errors import DeltalensError
from deltalens.io.source import TensorSource
from deltalens.io.spec import ModelRef, default_labels
from deltalens.io.tensors import open_tensors, references

GROUPS = ("embed", "lm_head", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_o", "attn_bias",
          "mlp_gate", "mlp_up", "mlp_down", "norm", "other")
CHUNK = 1 << 18  # coordinates per reduction step: 256K float32 = 1 MB per temporary, so the ~14 passes
#                  over a chunk hit the CPU cache (2.1x faster than 16 MB chunks on 28M coordinates)
PIECE = 1 << 21   # coordinates per read-ahead job of a streamed tensor: 8 MB per side in float32
BLOCK = 1024      # top-k candidate search: block maxima first, then only blocks that hold a candidate
LANES = 16        # |Δ| top-k: a chunk viewed as LANES rows, a max per column (see _grouped_above)
GROUPED_MIN = 1 << 14   # chunks of fewer coordinates search both top-k lists over the whole chunk
DENSE = 1 / 16    # ... as does the relative list where more than this share of a chunk passes its filter
METRIC_KEYS = ("n", "l2", "base_l2", "rel_l2", "max_abs", "mean_abs", "frac_changed", "frac_above_tol")
# RMSNorm as x * (1 + w): these architectures (config model_type) store w, and 1 + w is the scale that acts
ONE_PLUS_W_NORMS = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})

# ----------------------------------------------------------------------------------------------
# parameter groups

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer|block)\.(\d+)\.")
_EMBED = {"embed_tokens", "wte", "wpe", "word_embeddings", "embed_positions", "tok_embeddings", "embed_in"}
_LM_HEAD = {"lm_head", "embed_out", "output"}
_ATTN = {"self_attn", "attn", "attention", "self_attention", "mixer"}
_Q, _K, _V = {"q_proj", "query", "wq", "q"}, {"k_proj", "key", "wk", "k"}, {"v_proj", "value", "wv", "v"}
_QKV = {"c_attn", "qkv_proj", "query_key_value", "Wqkv", "qkv", "in_proj"}
_O = {"o_proj", "out_proj", "c_proj", "dense", "wo", "o"}
_GATE, _UP = {"gate_proj", "w1"}, {"up_proj", "c_fc", "w3", "fc1", "dense_h_to_4h", "fc_in"}
_DOWN = {"down_proj", "c_proj", "w2", "fc2", "dense_4h_to_h", "fc_out"}


def param_group(name: str) -> tuple[str, int | None]:
    """(group, layer index or None) of a parameter name, for Llama/Qwen2/Mistral/Gemma/GPT-2 naming.

    >>> param_group("model.layers.3.self_attn.q_proj.weight")
    ('attn_q', 3)
    >>> param_group("transformer.h.0.attn.c_attn.weight")
    ('attn_qkv', 0)
    """
    m = _LAYER.search(name)
    layer = int(m.group(1)) if m else None
    parts = name.split(".")
    leaf = parts[-1]                                   # weight | bias | (a buffer name)
    module = parts[-2] if len(parts) > 1 else ""       # q_proj, c_attn, input_layernorm, ...
    if module in _EMBED:
        return "embed", layer
    if module in _LM_HEAD and layer is None:
        return "lm_head", layer
    if "norm" in module.lower() or module.startswith("ln_") or module == "ln_f":
        return "norm", layer
    in_attn = any(p in _ATTN for p in parts[:-1])
    if in_attn and module in _ATTN:
        return "other", layer                          # GPT-2's attn.bias / attn.masked_bias mask buffers
    if in_attn and module in _Q | _K | _V | _QKV | _O:
        if leaf == "bias":
            return "attn_bias", layer
        if module in _QKV:
            return "attn_qkv", layer
        return {**{k: "attn_q" for k in _Q}, **{k: "attn_k" for k in _K}, **{k: "attn_v" for k in _V},
                **{k: "attn_o" for k in _O}}[module], layer
    if module in _GATE:
        return "mlp_gate", layer
    if module in _UP:
        return "mlp_up", layer
    if module in _DOWN:
        return "mlp_down", layer
    return "other", layer


# ----------------------------------------------------------------------------------------------
# sums -> metrics


@dataclass
class Sums:
    """Additive statistics of Δ over a set of coordinates; metrics() derives the schema's METRICS."""

    n: int = 0             # finite coordinates compared
    sq: float = 0.0        # Σ Δ²
    base_sq: float = 0.0   # Σ θ0²
    abs: float = 0.0       # Σ |Δ|
    max_abs: float = 0.0   # max |Δ|
    changed: int = 0       # #(Δ != 0)
    above: int = 0         # #(|Δ| > tol)

    def __iadd__(self, o: Sums):
        self.n += o.n
        self.sq += o.sq
        self.base_sq += o.base_sq
        self.abs += o.abs
        self.max_abs = max(self.max_abs, o.max_abs)
        self.changed += o.changed
        self.above += o.above
        return self

    def metrics(self) -> dict:
        l2, base_l2 = math.sqrt(self.sq), math.sqrt(self.base_sq)
        n = self.n
        return {"n": n, "l2": l2, "base_l2": base_l2, "rel_l2": l2 / base_l2 if base_l2 > 0 else None,
                "max_abs": self.max_abs, "mean_abs": self.abs / n if n else None,
                "frac_changed": self.changed / n if n else None,
                "frac_above_tol": self.above / n if n else None}


def above_indices(x: torch.Tensor, thr: float) -> torch.Tensor:
    """Flat indices i (ascending) with x[i] > thr, for 1-D x without NaN where such i are rare.

    A compare + nonzero over the whole of x costs ~1.5 ns per coordinate (the bool tensor and the
    scan); the max of each BLOCK-sized block costs ~0.06 ns, and then only the few blocks whose max
    beats thr are compared and scanned.
    """
    n = x.numel()
    m = n - n % BLOCK
    if m < 16 * BLOCK:                                 # small: the block step would not pay
        return torch.nonzero(x > thr).squeeze(1)
    blocks = x[:m].view(-1, BLOCK)                     # (n // BLOCK, BLOCK), no copy
    hit = torch.nonzero(blocks.amax(1) > thr).squeeze(1)
    row, col = torch.nonzero(blocks[hit] > thr, as_tuple=True)
    idx = hit[row] * BLOCK + col
    if m < n:                                          # the tail that does not fill a block
        idx = torch.cat([idx, torch.nonzero(x[m:] > thr).squeeze(1) + m])
    return idx


class TopK:
    """Running top-k of (score, tensor id, flat index, Δ, θ0) over a stream of chunks.

    Each chunk is first filtered against the current k-th best score (`threshold`), so after the
    first chunks only a handful of candidates reach torch.topk. The list is kept in numpy arrays:
    a merge is a dozen ops on ~k entries, where a torch op's ~5-10 µs overhead would be most of the
    cost (~85 µs a merge); torch.topk still picks the entries, so ties resolve as they always have.
    """

    def __init__(self, k: int):
        self.k = k
        self.score = np.empty(0, np.float32)
        self.rows = np.empty((0, 2), np.int64)             # (tensor id, flat index)
        self.vals = np.empty((0, 2), np.float32)           # (Δ, θ0)
        self._thr = 0.0                                    # threshold(), kept as a float: no sync per call

    def threshold(self) -> float:
        """Scores must beat this to enter: the k-th best so far, or 0 while not full."""
        return self._thr

    def push(self, score: torch.Tensor, tid: int, offset: int, d: torch.Tensor, b: torch.Tensor) -> int:
        """score/d/b: 1-D float32 chunk starting at flat index `offset`; eligible: finite score > 0."""
        if self.k == 0 or score.numel() == 0:
            return 0
        thr = self.threshold()
        if thr > 0:                                    # full: only scores beating the k-th best
            i = above_indices(score, thr)
            return self.push_at(i, score[i], tid, offset, d, b)
        s, i = torch.topk(score, min(self.k, score.numel()))  # filling up: this chunk's best k
        keep = s > 0
        return self.push_at(i[keep], s[keep], tid, offset, d, b)

    def push_at(self, i: torch.Tensor, s: torch.Tensor, tid: int, offset: int, d: torch.Tensor,
                b: torch.Tensor) -> int:
        """Merge candidates at chunk positions `i` (int64) with scores `s` (float32); returns how
        many had s = inf (|Δ|/|θ0| with θ0 = 0), which are skipped."""
        if self.k == 0 or i.numel() == 0:
            return 0
        s, i = s.numpy(), i.numpy()
        finite = np.isfinite(s)
        n_inf = int(s.size - np.count_nonzero(finite))
        if n_inf:
            s, i = s[finite], i[finite]
        if s.size > self.k:
            top, j = torch.topk(torch.from_numpy(s), self.k)
            s, i = top.numpy(), i[j.numpy()]
        self.score = np.concatenate([self.score, s])
        self.rows = np.concatenate([self.rows, np.stack([np.full_like(i, tid), i + offset], 1)])
        self.vals = np.concatenate([self.vals, np.stack([d.numpy()[i], b.numpy()[i]], 1)])
        if self.score.size > self.k:
            top, j = torch.topk(torch.from_numpy(self.score), self.k)
            j = j.numpy()
            self.score, self.rows, self.vals = top.numpy(), self.rows[j], self.vals[j]
        if self.score.size >= self.k:
            self._thr = float(self.score.min())
        return n_inf

    def result(self, names: list[str]) -> dict:
        order = torch.argsort(torch.from_numpy(self.score), descending=True, stable=True)
        entries = [{"name": names[int(self.rows[j, 0])], "index": int(self.rows[j, 1]),
                    "delta": float(self.vals[j, 0]), "base": float(self.vals[j, 1])} for j in order.tolist()]
        counts = Counter(param_group(e["name"])[0] for e in entries)
        return {"composition": {g: counts[g] for g in GROUPS if counts[g]}, "entries": entries}


# ----------------------------------------------------------------------------------------------
# top-k candidates of one chunk
#
# Once a list is full, a coordinate enters only if its score beats the k-th best (`threshold`), which
# few do, so each list first narrows a chunk down to a superset of those coordinates with one cheap
# pass, then scores only them with the same ops as a full pass: the candidates (ascending indices)
# and their scores are bit for bit those of the full pass (`_rank_rel_dense`, `above_indices`).
# - |Δ| (`_grouped_above`): the chunk viewed as LANES rows of `cols`; column j holds coordinates
#   j, j + cols, ... Its max (one vectorised pass, which also gives max_abs) bounds the column.
# - |Δ|/|θ0| (`_rank_rel_sparse`): rounding is monotone, so fl(|Δ|/|θ0|) > thr needs the exact
#   quotient above thr, i.e. |θ0| < max_abs / thr; a float32 below a real number is at most that
#   number rounded to float32 (via float64 too), so |θ0| <= tau = fl32(max_abs / thr) passes every
#   coordinate that can enter, and every θ0 = 0, so the zero-base count comes from the candidates too.
#   On the SmolLM2 bench pair that leaves ~0.3% of a chunk (mostly θ0 = 0); a full pass of the ratio
#   costs ~2.5 ns per coordinate (abs, eq, dot, div, nan_to_num, amax), this filter ~0.8 ns.


def _grouped_above(x: torch.Tensor, x_max: torch.Tensor, thr: float) -> torch.Tensor:
    """above_indices(x, thr) from x's column maxima x_max (x viewed as LANES rows of x_max.numel()),
    in numpy: numpy's compare costs ~0.15 ns a coordinate, torch's ~2 ns (its bool output)."""
    x_np, cols = x.numpy(), x_max.numel()
    m0 = cols * LANES
    hit = np.flatnonzero(x_max.numpy() > thr)
    row, col = np.nonzero(x_np[:m0].reshape(LANES, cols)[:, hit] > thr)   # row-major: idx ascends
    idx = row * cols + hit[col]
    if m0 < x_np.size:                                     # the tail that does not fill a row
        idx = np.concatenate([idx, np.flatnonzero(x_np[m0:] > thr) + m0])
    return torch.from_numpy(idx)


def _rank_rel_dense(top: TopK, a, b, d, t, g1, g2, tid: int, offset: int, t_ready: bool = False) -> int:
    """Push a chunk's |Δ|/|θ0| into the relative top-k over the whole chunk (the list is filling up,
    or the chunk is small, or the filter would pass too much). Returns #changed coordinates with
    θ0 = 0 (not ranked). t: a chunk buffer, holding |θ0| already if t_ready, and g1 a bool one (both
    overwritten); g2: numpy bool, True where changed."""
    zero_base = 0
    if not t_ready:
        torch.abs(b, out=t)                                # |θ0|
    if float(t.amin()) == 0:                               # changed coordinates with θ0 = 0: counted, not ranked
        np.equal(t.numpy(), 0, out=g1)
        zero_base = int(np.count_nonzero(np.logical_and(g1, g2, out=g1)))
    # |Δ|/|θ0|, made 0 (never ranked) where it is nan (Δ = 0 = θ0) or inf (θ0 = 0, or an overflow
    # against a subnormal θ0): an inf would take a top-k slot while the list fills up
    torch.div(a, t, out=t).nan_to_num_(nan=0.0, posinf=0.0)
    if float(t.amax()) > top.threshold():
        top.push(t, tid, offset, d, b)
    return zero_base


def _rank_rel_sparse(top: TopK, a, b, d, t, g1, g2, max_abs: float, tid: int, offset: int) -> int:
    """The same as _rank_rel_dense for a full list, scoring only the coordinates with |θ0| <= tau
    (see above); the dense pass when tau overflows float32 or more than DENSE of the chunk passes."""
    tau = max_abs / top.threshold()                       # threshold > 0: the list is full
    if not tau < 3e38:                                     # no float32 bound: nothing to filter with
        return _rank_rel_dense(top, a, b, d, t, g1, g2, tid, offset)
    torch.abs(b, out=t)                                    # |θ0|
    t_np = t.numpy()
    cand = np.flatnonzero(np.less_equal(t_np, np.float32(tau), out=g1))
    if cand.size > DENSE * t_np.size:
        return _rank_rel_dense(top, a, b, d, t, g1, g2, tid, offset, t_ready=True)
    # the candidates in numpy: a few hundred coordinates, where a torch op's ~10 µs overhead dominates;
    # its float32 division is IEEE's, as torch's, so the scores are the same bits
    ac, tc = a.numpy()[cand], t_np[cand]
    zero_base = int(np.count_nonzero((tc == 0) & (ac > 0)))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):   # inf and nan become 0, as in torch
        ratio = np.nan_to_num(ac / tc, nan=0.0, posinf=0.0)
    keep = np.flatnonzero(ratio > top.threshold())
    if keep.size:
        top.push_at(torch.from_numpy(cand[keep]), torch.from_numpy(ratio[keep]), tid, offset, d, b)
    return zero_base


# ----------------------------------------------------------------------------------------------
# one tensor pair


_STAGGER = 1040  # floats (4160 bytes) between workspace buffers, so that element i of each lies in a
#                  different 4 KB page offset and cache set (same-offset streams alias and conflict)


def workspace(size: int = 0) -> torch.Tensor:
    """Scratch memory for tensor_sums: three float32 and two bool chunk buffers in one allocation,
    reusable across calls (`_buffers` carves them).

    Reuse matters: a fresh 5 MB per call is page-faulted in again each time (glibc returns it to the
    OS on free), which tripled the reduction time of a streamed diff made of many small pieces.
    """
    size = size or CHUNK
    return torch.empty(3 * (size + _STAGGER) + 2 * (-(-size // 4) + _STAGGER))


def _buffers(work: torch.Tensor, size: int):
    """(d, a, t) float32 tensors and (g1, g2) numpy bool arrays of `size` elements, inside `work`."""
    stride, bstride = size + _STAGGER, -(-size // 4) + _STAGGER
    floats = [work[i * stride:i * stride + size] for i in range(3)]
    bools = [work[3 * stride + i * bstride:3 * stride + (i + 1) * bstride].view(torch.uint8)[:size]
             .numpy().view(np.bool_) for i in range(2)]
    return floats, bools


def tensor_sums(base: torch.Tensor, ckpt: torch.Tensor, tol: float, tops: tuple[TopK, TopK] | None = None,
                tid: int = 0, offset: int = 0, work: torch.Tensor | None = None) -> tuple[Sums, int, int, int]:
    """Reduce one tensor pair (same shape, any float dtypes) in float32 chunks. `offset` is the flat
    index of their first coordinate when they are a piece of a larger tensor (for top-k indices);
    `work` is a workspace() to reuse (else one is allocated).

    Returns (sums over finite coordinates, #non-finite in base, #non-finite in ckpt, #changed
    coordinates with θ0 == 0 that the relative top-k skipped). Feeds `tops` = (abs, rel) if given.

    Speed: this loop is the whole cost of a diff after I/O, so every step writes into preallocated
    chunk buffers (a fresh tensor per op costs an allocation and page faults) and avoids the slow
    ops: counts are numpy compares into a bool buffer + np.count_nonzero (~0.3 ns per coordinate;
    torch's compare to bool alone costs ~1.7 ns, a 0/1 float compare + sum ~0.6 ns, count_nonzero
    ~4.4 ns), and once a top-k list is full only the coordinates that a one-pass filter lets through
    are scored (`_grouped_above`, `_rank_rel_sparse`). About 11 memory passes per coordinate with
    the top-k lists, 8 without; see benchmarks/bench_diff.py.
    """
    b_all, c_all = base.reshape(-1), ckpt.reshape(-1)
    size = min(CHUNK, b_all.numel())
    if work is None or work.numel() < workspace(size).numel():
        work = workspace(size)
    (d_buf, a_buf, t_buf), (g1_buf, g2_buf) = _buffers(work, size)
    s, bad_b, bad_c, zero_base = Sums(), 0, 0, 0
    for lo in range(0, b_all.numel(), CHUNK):
        b = b_all[lo:lo + CHUNK].float()                   # no copy when already float32
        c = c_all[lo:lo + CHUNK].float()
        m = b.numel()
        d, a, t, g1, g2 = d_buf[:m], a_buf[:m], t_buf[:m], g1_buf[:m], g2_buf[:m]
        torch.sub(c, b, out=d)                             # Δ
        n, sq, base_sq = m, float(torch.dot(d, d)), float(torch.dot(b, b))
        if not (math.isfinite(sq) and math.isfinite(base_sq)):   # slow path only if NaN/Inf present
            fb, fc = torch.isfinite(b), torch.isfinite(c)
            bad_b += int((~fb).sum())
            bad_c += int((~fc).sum())
            ok = fb & fc & torch.isfinite(d)
            n = int(ok.sum())
            d.masked_fill_(~ok, 0.0)                       # zero out, keeping flat indices aligned
            b = torch.where(ok, b, 0.0)
            sq, base_sq = float(torch.dot(d, d)), float(torch.dot(b, b))
        torch.abs(d, out=a)                                # |Δ|
        a_np = a.numpy()
        changed = int(np.count_nonzero(np.greater(a_np, 0, out=g2)))   # #(|Δ| > 0); g2: where changed
        ranked = tops is not None and tops[0].k > 0 and changed > 0
        cols = m // LANES if ranked and m >= GROUPED_MIN else 0
        if cols:                                           # column maxima: max_abs and the top-k bounds
            a_max = a[:cols * LANES].view(LANES, cols).amax(0)   # (cols,) max |Δ| of each column
            max_abs = float(a_max.amax())
            if cols * LANES < m:
                max_abs = max(max_abs, float(a[cols * LANES:].amax()))
        else:
            max_abs = float(a.amax())
        if max_abs <= tol:
            above = 0
        elif tol > 0:
            above = int(np.count_nonzero(np.greater(a_np, tol, out=g1)))   # #(|Δ| > tol)
        else:
            above = changed
        s += Sums(n=n, sq=sq, base_sq=base_sq, abs=float(a.sum()), max_abs=max_abs, changed=changed,
                  above=above)
        if not ranked:
            continue
        if max_abs > tops[0].threshold():                  # else no coordinate here can enter
            if cols and tops[0].threshold() > 0:
                i = _grouped_above(a, a_max, tops[0].threshold())
                tops[0].push_at(i, a[i], tid, offset + lo, d, b)
            else:
                tops[0].push(a, tid, offset + lo, d, b)
        if cols and tops[1].threshold() > 0:
            zero_base += _rank_rel_sparse(tops[1], a, b, d, t, g1, g2, max_abs, tid, offset + lo)
        else:
            zero_base += _rank_rel_dense(tops[1], a, b, d, t, g1, g2, tid, offset + lo)
    return s, bad_b, bad_c, zero_base


def svd_summary(base: torch.Tensor, ckpt: torch.Tensor, top: int) -> dict:
    """Top singular values of ΔW (2-D) and its entropy effective rank exp(H(σ/Σσ)). Non-finite
    coordinates (NaN/Inf on either side) count as unchanged, as in every other metric."""
    dw = (ckpt.float() - base.float()).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    sv = torch.linalg.svdvals(dw.double())
    total = float(sv.sum())
    if total == 0:
        return {"top": [0.0] * min(top, sv.numel()), "effective_rank": 0.0}
    p = sv / total
    p = p[p > 0]
    return {"top": [float(x) for x in sv[:top]], "effective_rank": float(torch.exp(-(p * p.log()).sum()))}


# ----------------------------------------------------------------------------------------------
# one checkpoint against its base


def _names_list(kind: str, names: list[str], limit: int = 5) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return f"{kind} ({len(names)}): {', '.join(names[:limit])}{more}"


@contextlib.contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Run torch's CPU ops on n threads for the duration (the process-wide setting is restored).

    The reduction works on 1 MB chunks, where an intra-op thread team's fork/join costs more than it
    saves, and the read-ahead thread needs a core of its own: on 2 cores, a diff of the SmolLM2-135M
    pair took 1.3 s with 2 torch threads and 0.84 s with 1 (benchmarks/bench_diff.py, medians of 5).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Exempt the objects alive now (torch's ~170k after import) from garbage collection for the
    duration: the loop's small allocations otherwise trigger a full collection that scans them all,
    75 ms of a 0.5 s diff of the SmolLM2-135M pair. New objects are still collected. Does nothing
    when the application froze objects itself (unfreezing would undo that)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


ALIGN = 64  # bytes: regions of the read-ahead arena start at multiples of this (any dtype can view them)


def _aligned(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


class _Arena:
    """A byte ring for read-ahead: variable-size regions taken in order and released in the same
    order (FIFO), so the reader can run several tensor pairs ahead inside a fixed memory budget.

    Used [tail, head) when not wrapped; [tail, end) + [0, head) when wrapped (then head <= tail).
    take() blocks until the region fits; close() wakes a blocked take(), which then raises.
    """

    def __init__(self, capacity: int, buffered: bool = True):
        # pages are touched (counted in RSS) when used; unbuffered: only the accounting, take() -> None
        self.buf = torch.empty(capacity, dtype=torch.uint8) if buffered else None
        self.capacity = capacity
        self.regions: deque[tuple[int, int]] = deque()       # (start, end), oldest first
        self.head = 0
        self.closed = False
        self.cond = threading.Condition()

    def _start(self, n: int) -> int | None:
        if not self.regions:
            return 0
        tail = self.regions[0][0]
        if self.head > tail:                                  # not wrapped: free [head, cap) and [0, tail)
            if self.capacity - self.head >= n:
                return self.head
            return 0 if tail >= n else None
        return self.head if tail - self.head >= n else None   # wrapped: free [head, tail)

    def take(self, n: int) -> torch.Tensor:
        """A region of n bytes (n <= capacity, a multiple of ALIGN)."""
        if n > self.capacity:
            raise ValueError(f"a {n}-byte region cannot fit in a {self.capacity}-byte arena")
        with self.cond:
            while (start := self._start(n)) is None and not self.closed:
                self.cond.wait()
            if self.closed:
                raise RuntimeError("read-ahead arena closed")
            self.regions.append((start, start + n))
            self.head = start + n
            return None if self.buf is None else self.buf[start:start + n]

    def release(self) -> None:
        """Free the oldest region."""
        with self.cond:
            self.regions.popleft()
            if not self.regions:
                self.head = 0
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _prefetched(jobs: list, load, nbytes, buffered: bool = True) -> Iterator[tuple]:
    """Yield (job, load(job, region)) in order while a background thread reads ahead.

    Reading (file I/O, page-cache copies) releases the GIL, and so do torch's kernels, so later
    pairs are read while the current one is reduced: a diff then costs about max(read, compute)
    instead of their sum. The reader fills regions of one reused arena (`load` gets a uint8 region
    of nbytes(job) bytes to read into; reused pages read ~2x faster than fresh allocations) and
    runs ahead as far as the arena allows: 1.25x the largest job, at least 64 MB. Streamed jobs are
    PIECE-sized, so that is 64 MB. With buffered=False (sources that read whole tensors into fresh
    memory: GGUF, .pt) `load` gets None and the arena only counts bytes, ~2.5x the largest tensor.
    A yielded job's tensors are valid until the next one is requested: their region is then handed
    back to the reader.
    """
    if not jobs:
        return
    sizes = [nbytes(j) for j in jobs]
    arena = _Arena(max(int(1.25 * max(sizes)), 64 * 2**20, max(sizes)), buffered)
    done: queue.Queue = queue.Queue()

    def reader():
        try:
            for job, size in zip(jobs, sizes):
                done.put((job, load(job, arena.take(size))))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            done.put(e)

    thread = threading.Thread(target=reader, name="deltalens-read", daemon=True)
    thread.start()
    try:
        for _ in jobs:
            item = done.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            del item
            arena.release()
    finally:
        arena.close()
        thread.join()


@dataclass
class _Pairs:
    """Step 1 of a diff: which tensors are compared with which (tied names resolved), and what is not."""

    pairs: list[tuple[str, str, str]]   # (name, base name, ckpt name)
    missing: list[str]
    extra: list[str]
    retied: list[str]


def _match_names(base: TensorSource, ckpt: TensorSource) -> _Pairs:
    """Pair every tensor of the checkpoint with its base tensor; tied groups count once (every member
    but the first is an alias of the first on that side)."""
    base_names, ckpt_names = base.names(), ckpt.names()
    base_set, ckpt_set = set(base_names), set(ckpt_names)
    b_alias = {m: g[0] for g in base.tied() for m in g[1:]}
    c_alias = {m: g[0] for g in ckpt.tied() for m in g[1:]}

    def real(name, names, alias):
        return name in names and name not in alias

    out = _Pairs([], [], [], [])
    for name in dict.fromkeys(ckpt_names + base_names + list(c_alias) + list(b_alias)):
        in_b, in_c = real(name, base_set, b_alias), real(name, ckpt_set, c_alias)
        if not in_b and not in_c:
            continue                                        # tied (or absent) on both sides: counted once
        if in_c and not in_b and name not in b_alias:
            out.extra.append(name)
            continue
        if in_b and not in_c and name not in c_alias:
            out.missing.append(name)
            continue
        bn = name if in_b else b_alias[name]
        cn = name if in_c else c_alias[name]
        if bn != cn:
            out.retied.append(f"{name} (compared with {bn if bn != name else cn})")
        out.pairs.append((name, bn, cn))
    return out


def _read_jobs(base: TensorSource, ckpt: TensorSource, pairs, svd: int, streams: bool):
    """Step 2: the read jobs (tid, name, bn, cn, float?, lo, hi) = coordinates [lo, hi) of a tensor pair,
    and the pairs skipped for their shape / compared across dtypes. Float tensors of sources that read
    ranges (safetensors) stream in PIECE-sized jobs, so reading and reducing overlap from the first MB on
    and memory stays at the read-ahead arena whatever the tensor sizes; everything else (GGUF, .pt,
    integer buffers, tensors for svd) is one job."""
    jobs, shape_bad, dtype_bad = [], [], []
    for tid, (name, bn, cn) in enumerate(pairs):
        bs, cs = base.shape(bn), ckpt.shape(cn)
        if bs != cs:
            shape_bad.append(f"{name} {list(bs)} vs {list(cs)}")
            continue
        bd, cd = base.dtype(bn), ckpt.dtype(cn)
        is_float = bd.is_floating_point and cd.is_floating_point
        if is_float and bd != cd:
            dtype_bad.append(f"{name} {str(bd).removeprefix('torch.')} vs {str(cd).removeprefix('torch.')}")
        n = math.prod(bs)
        step = PIECE if streams and is_float and not (svd and len(bs) == 2) else max(n, 1)
        jobs += [(tid, name, bn, cn, is_float, lo, min(lo + step, n)) for lo in range(0, max(n, 1), step)]
    return jobs, shape_bad, dtype_bad


@dataclass
class _Reduced:
    """Step 3's result: the sums at every level, the tensor entries and what the warnings need."""

    whole: Sums
    groups: dict
    layers: dict
    tensors: list
    dtypes: Counter
    nonfinite: list
    skipped_int: list
    zero_base: int
    acting_sq: float = 0.0  # Σ (1 + θ0)² over the norm group's finite coordinates, for a 1 + w architecture


def _reduce(base: TensorSource, ckpt: TensorSource, jobs, n_pairs: int, tol: float, tops, svd: int,
            streams: bool, progress, one_plus_w: bool = False) -> _Reduced:
    """Step 3: stream the jobs (read ahead in a background thread, `_prefetched`) and reduce each tensor
    pair piece by piece (`tensor_sums`) into its entry and the group / layer / whole sums (and, with
    `one_plus_w`, Σ (1 + θ0)² over the norm weights: `norm_convention`)."""
    out = _Reduced(Sums(), {}, {}, [], Counter(), [], [], 0)

    def load(job, region):
        _, _, bn, cn, _, lo, hi = job
        if region is None:                                 # whole-tensor sources: fresh tensors
            return base.read_range(bn, lo, hi), ckpt.read_range(cn, lo, hi)
        nb = _aligned((hi - lo) * base.dtype(bn).itemsize)
        return base.read_range(bn, lo, hi, region[:nb]), ckpt.read_range(cn, lo, hi, region[nb:])

    def nbytes(job):
        _, _, bn, cn, _, lo, hi = job
        return _aligned((hi - lo) * base.dtype(bn).itemsize) + _aligned((hi - lo) * ckpt.dtype(cn).itemsize)

    acc = Sums()                                           # the tensor being reduced, over its pieces
    bad = [0, 0]                                           # its non-finite counts (base, checkpoint)
    threads, work = torch.get_num_threads(), workspace()
    # Streamed: one torch thread, as the reader thread has another core (whole-tensor sources keep
    # torch's threads for their dequantisation). closing: on an error, stop the reader at once.
    with (torch_threads(1) if streams else contextlib.nullcontext()), gc_frozen(), \
            contextlib.closing(_prefetched(jobs, load, nbytes, buffered=streams)) as stream:
        for (tid, name, bn, cn, is_float, lo, hi), (b, c) in stream:
            shape = base.shape(bn)
            n = math.prod(shape)
            if not is_float:                                   # integer buffers: not parameters
                if not torch.equal(b, c):
                    out.skipped_int.append(name)
                if progress is not None:
                    progress(tid + 1, n_pairs)
                continue
            if lo == 0:
                acc, bad = Sums(), [0, 0]
                group, layer = param_group(name)
            s, bad_b, bad_c, zb = tensor_sums(b, c, tol, tops, tid, offset=lo, work=work)
            if one_plus_w and group == "norm":
                acting = b.double() + 1
                out.acting_sq += float(acting[acting.isfinite()].square().sum())
            acc += s
            bad[0] += bad_b
            bad[1] += bad_c
            out.zero_base += zb
            if hi < n:
                continue                                       # more pieces of this tensor to come
            if bad[0] or bad[1]:
                out.nonfinite.append(f"{name} (base {bad[0]}, checkpoint {bad[1]})")
            out.whole += acc
            out.groups.setdefault(group, Sums()).__iadd__(acc)
            out.layers.setdefault((layer, group), Sums()).__iadd__(acc)
            cd = str(ckpt.dtype(cn)).removeprefix("torch.")
            out.dtypes[cd] += acc.n
            entry = {"name": name, "group": group, "layer": layer, "shape": list(shape), "dtype": cd,
                     **acc.metrics()}
            if svd and len(shape) == 2:
                with torch_threads(threads):               # a LAPACK call that uses every core
                    entry["svd"] = svd_summary(b.view(shape), c.view(shape), svd)
            out.tensors.append(entry)
            if progress is not None:
                progress(tid + 1, n_pairs)
            del b, c
    return out


def _warnings(base: TensorSource, ckpt: TensorSource, matched: _Pairs, shape_bad, dtype_bad, red: _Reduced,
              topk: int, strict: bool) -> list[str]:
    """Step 4: the entry's warnings (mismatches first); with `strict`, the first mismatch is an error."""
    mismatches = []
    if matched.missing:
        mismatches.append(_names_list("missing from the checkpoint", matched.missing))
    if matched.extra:
        mismatches.append(_names_list("not in the base", matched.extra))
    if shape_bad:
        mismatches.append(_names_list("shape differs (skipped)", shape_bad))
    if dtype_bad:
        mismatches.append(_names_list("dtype differs (compared in float32)", dtype_bad))
    if strict and mismatches:
        raise DeltalensError(f"checkpoint {ckpt.path} does not match base {base.path}: {mismatches[0]}; "
                             "drop --strict to compare the common tensors")
    warnings = list(mismatches)
    if matched.retied:
        warnings.append(_names_list("tied on one side only", matched.retied))
    if red.skipped_int:
        warnings.append(_names_list("non-float tensors differ (not analysed)", red.skipped_int))
    if red.nonfinite:
        warnings.append(_names_list("NaN/Inf values excluded from metrics", red.nonfinite))
    if red.zero_base and topk:
        warnings.append(f"{red.zero_base} changed coordinates have base value 0 and are not ranked "
                        "in the relative top-k")
    if not red.tensors:
        warnings.append("no floating-point tensors in common: nothing compared")
    return warnings


def diff_sources(base: TensorSource, ckpt: TensorSource, *, tol: float = 1e-6, topk: int = 100,
                 strict: bool = False, svd: int = 0, progress=None) -> dict:
    """The schema's diff[label] entry for one checkpoint vs its base (both already open): match the
    names (`_match_names`), plan the reads (`_read_jobs`), stream and reduce them (`_reduce`), then the
    warnings (`_warnings`) and the entry.

    `progress` is an optional callable(done: int, total: int) called once per tensor processed.
    """
    matched = _match_names(base, ckpt)
    names = [p[0] for p in matched.pairs]
    streams = base.partial_reads and ckpt.partial_reads
    jobs, shape_bad, dtype_bad = _read_jobs(base, ckpt, matched.pairs, svd, streams)
    tops = (TopK(topk), TopK(topk))
    model_type = norm_model_type(base.config)
    red = _reduce(base, ckpt, jobs, len(matched.pairs), tol, tops, svd, streams, progress,
                  one_plus_w=model_type in ONE_PLUS_W_NORMS)
    warnings = _warnings(base, ckpt, matched, shape_bad, dtype_bad, red, topk, strict)

    def order(key):
        layer, group = key
        return (layer is None, layer if layer is not None else 0, GROUPS.index(group))

    out = {
        "dtype": "+".join(d for d, _ in red.dtypes.most_common()) or None,
        "n_params": red.whole.n,
        "tol": tol,
        "whole": red.whole.metrics(),
        "groups": {g: red.groups[g].metrics() for g in GROUPS if g in red.groups},
        "layers": [{"layer": lay, "group": g, **red.layers[(lay, g)].metrics()}
                   for lay, g in sorted(red.layers, key=order)],
        "tensors": red.tensors,
        "topk": {"k": topk, "abs": tops[0].result(names), "rel": tops[1].result(names)},
        "tied": ckpt.tied(),
        "warnings": warnings,
    }
    if model_type in ONE_PLUS_W_NORMS and "norm" in red.groups:
        out["norm_convention"] = norm_convention(model_type, red.groups["norm"], red.acting_sq)
    return out


def norm_model_type(config: dict) -> str | None:
    """The architecture's model_type (a multimodal config's text_config's where it has one)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return text.get("model_type") or config.get("model_type")


def norm_convention(model_type: str, norm: Sums, acting_sq: float) -> dict:
    """The norm group of an architecture whose RMSNorm scales by 1 + w: the stored w (what every other
    figure of the diff uses, as transformers holds it) beside the acting scale 1 + w. Δ is the same on
    both; the base it is relative to is not: rel_l2 over ||1 + θ0|| is how much the norms' effect moved.
    Means of θ0 from the sums: Σθ0 = (Σ(1 + θ0)² - Σθ0² - n) / 2."""
    n, l2 = norm.n, math.sqrt(norm.sq)
    acting_l2 = math.sqrt(acting_sq)
    mean = (acting_sq - norm.base_sq - n) / 2 / n if n else None
    return {"model_type": model_type, "stored": "w", "acting": "1 + w", "n": n, "l2": l2,
            "base_l2_stored": math.sqrt(norm.base_sq), "base_l2_acting": acting_l2,
            "rel_l2_stored": l2 / math.sqrt(norm.base_sq) if norm.base_sq > 0 else None,
            "rel_l2_acting": l2 / acting_l2 if acting_l2 > 0 else None,
            "base_mean_stored": mean, "base_mean_acting": None if mean is None else mean + 1}


def rel_l2_ratios(diff: dict) -> list[dict]:
    """rel_l2(a) / rel_l2(b) for every pair a before b (in the diff's order); null if undefined."""
    labels = list(diff)
    out = []
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            ra, rb = diff[a]["whole"]["rel_l2"], diff[b]["whole"]["rel_l2"]
            out.append({"a": a, "b": b, "rel_l2_ratio": ra / rb if ra is not None and rb else None})
    return out


def diff_checkpoints(base_path, ckpt_paths, labels: list[str] | None = None, tol: float = 1e-6,
                     topk: int = 100, strict: bool = False, progress: bool = True, svd: int = 0,
                     arch: str | None = None) -> dict:
    """Compare checkpoints with one base: {"diff": {label: ...}, "ratios": [...]} (see analysis-schema.md).

    Paths are anything `deltalens.io.tensors.open_tensors` reads, each resolved once (`references`); memory
    stays at a few tensors. `arch`: the architecture lent to bare weight files (their tied embeddings;
    module docstring).
    """
    ckpt_paths = [ckpt_paths] if isinstance(ckpt_paths, (str, Path, ModelRef)) else list(ckpt_paths)
    if not ckpt_paths:
        raise DeltalensError("give at least one checkpoint to compare with the base")
    labels = list(labels) if labels else default_labels(ckpt_paths)
    if len(labels) != len(ckpt_paths) or len(set(labels)) != len(labels):
        raise DeltalensError("labels must be unique and one per checkpoint")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True, disable=not progress)
    diff = {}
    base_ref, *refs = references([base_path, *ckpt_paths], arch)
    with bar, gc_frozen(), open_tensors(base_ref) as base:
        for label, ref in zip(labels, refs):
            with open_tensors(ref) as ckpt:
                task = bar.add_task(f"diff {label}", total=None)
                diff[label] = diff_sources(base, ckpt, tol=tol, topk=topk, strict=strict, svd=svd,
                                           progress=lambda done, total, t=task: bar.update(t, completed=done,
                                                                                           total=total))
                bar.remove_task(task)
    return {"diff": diff, "ratios": rel_l2_ratios(diff)}


def diff_table(doc: dict):
    """A pandas DataFrame with one row per (checkpoint, level, name): whole model, groups, (layer, group)
    cells and tensors; columns label, level, name, group, layer and the METRIC_KEYS (CSV export)."""
    import pandas as pd

    rows = []
    for label, d in doc["diff"].items():
        rows.append({"label": label, "level": "whole", **d["whole"]})
        rows += [{"label": label, "level": "group", "group": g, **m} for g, m in d["groups"].items()]
        rows += [{"label": label, "level": "layer", **r} for r in d["layers"]]
        rows += [{"label": label, "level": "tensor", **r} for r in d["tensors"]]
    columns = ["label", "level", "name", "group", "layer", *METRIC_KEYS]
    return pd.DataFrame.from_records([{k: r.get(k) for k in columns} for r in rows], columns=columns).astype(
        {"layer": "Int64", "n": "Int64"})


def diff_analysis(base_path, ckpt_paths, labels: list[str] | None = None, *, arch: str | ModelRef | None = None,
                  **kw) -> dict:
    """A complete analysis.json document (schema_version, base, models, diff, ratios) for a diff; each model
    spec (and `arch`) resolved once here (`references`), the diff and the models' entries take the references."""
    ckpt_paths = [ckpt_paths] if isinstance(ckpt_paths, (str, Path, ModelRef)) else list(ckpt_paths)
    labels = list(labels) if labels else default_labels(ckpt_paths)
    base_ref, *refs = references([base_path, *ckpt_paths], arch)
    result = diff_checkpoints(base_ref, refs, labels, **kw)
    return analysis_document(base_path, [model_entry(lab, r) for lab, r in zip(labels, refs)], **result)
