"""Delta sparsification: how much of a fine-tune's weight change is needed to keep its gains?

The procedure of arXiv 2608.27351 (ES vs GRPO weight changes; building on Qiu et al., arXiv
2509.24372): pick one global threshold τ on |Δ| (Δ = θ - θ0, float32) and reset every coordinate
with 0 < |Δ| <= τ to its base value. Then

    sparsity      = #reset / #changed          (changed = Δ != 0; share of the change removed)
    kept_l2_frac  = ||Δ_kept||₂ / ||Δ||₂       (how much of the distance survives)
    gain_retained = (p(τ) - p_base) / (p_full - p_base)   per Pass@K, null when p_full <= p_base

`thresholds_for_sparsity` turns target sparsities into exact τ (order statistics of |Δ| over the
changed coordinates) without sorting the model: pass 1 histograms the top 16 bits of the float32
bit patterns of |Δ| (monotone in value for non-negative floats), which locates the bucket holding
each wanted rank; pass 2 collects only those buckets' values and sorts them. Memory: a few tensors
plus the selected buckets (each a 2^-7 relative slice of the value range).

Choices / departures:
- τ(s) is the smallest threshold whose sparsity is >= s: the ceil(s·N)-th smallest changed |Δ|
  (ties can push the achieved sparsity above s; the achieved value is what is reported).
- Non-finite Δ coordinates are never reset and never ranked.
- Tied tensors (embedding == lm_head) are thresholded once and stay tied in the output.
- `gain_retained` (headline) is taken at the smallest requested K; every K is in
  `gain_retained_at_k`. Points made from a target sparsity carry `target_sparsity`.
- Evaluations of the base and of the full checkpoint are cached: a τ that resets nothing reuses the
  full-checkpoint result and a τ that resets every changed coordinate reuses the base result.

Noise. A share of a gain is only as good as the gain: +0.008 Pass@1 on 30 problems is noise, and a
"gain kept 1.50" of it means nothing. So each section carries `gain_ci`, the 95% paired bootstrap
interval over problems of the trained model's gain at the headline K (`deltalens.analysis.stats`), and
`gain_within_noise` (that interval contains 0); each point carries `gain_retained_ci`, the percentile
interval of (p(τ) - p_base) / (p_full - p_base) from the same problem resamples (`stats.gain_ratio`,
replicates without a positive gain dropped; null when most have none). Both need the evaluations'
per-problem results; without them they are null. A point that resets >= 99.9% of the changed
coordinates is (nearly) the base, whatever it "keeps": the section's `warnings` name it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from deltalens.analysis.delta import torch_threads
from deltalens.analysis.document import analysis_document, model_entry
from deltalens.errors import DeltalensError
from deltalens.io.atomic import save_state_dict
from deltalens.io.models import check_finite
from deltalens.io.source import DictSource, TensorSource
from deltalens.io.spec import default_label
from deltalens.io.tensors import load_state_dict, open_tensors, references

CHUNK = 1 << 22     # coordinates per step (16 MB of float32 per temporary)
_SHIFT = 16         # histogram key: top 16 bits of the float32 pattern (sign 0, 8 exponent, 7 mantissa)
_BUCKETS = 1 << 15  # sign bit is 0 for |Δ|, so keys fit in 15 bits
ALL_RESET = 0.999   # a point resetting this share of the changed coordinates is (nearly) the base


def _sq(x: torch.Tensor) -> float:
    """||x||², summed on one thread: a reduction split over a thread team adds in another order, so the
    same update gave kept_l2_frac 0.66347030803 with 2 threads and 0.66347030148 with 1 (a study on a Ray
    worker, OMP_NUM_THREADS=1, against the same study on the driver). One thread: one answer everywhere."""
    x = x.reshape(-1)
    with torch_threads(1):
        return float(torch.dot(x, x))


def check_points(taus: Sequence[float], sparsities: Sequence[float] = ()) -> None:
    """Refuse bad thresholds τ (finite, >= 0) and target sparsities (in [0, 1]) before any work: the
    sweep meets them only after loading both checkpoints and evaluating the base and the checkpoint."""
    if not len(taus) and not len(sparsities):
        raise DeltalensError("give at least one threshold (--thresholds) or target sparsity (--sparsity)")
    for tau in taus:
        if not (math.isfinite(tau) and tau >= 0):
            raise DeltalensError(f"threshold {tau} must be a finite number >= 0; use e.g. 2.5e-4,5e-4")
    for s in sparsities:
        if not 0 <= s <= 1:
            raise DeltalensError(f"target sparsity {s} is outside [0, 1]; use e.g. 0.5,0.9")


def _pairs(base: TensorSource, ckpt: TensorSource):
    """(name, base tensor, ckpt tensor) for the float tensors both share, tied aliases skipped."""
    skip = {m for g in ckpt.tied() for m in g[1:]}
    base_names = set(base.names())
    for name in ckpt.names():
        if name in skip or name not in base_names:
            continue
        if not (base.dtype(name).is_floating_point and ckpt.dtype(name).is_floating_point):
            continue
        if base.shape(name) != ckpt.shape(name):
            raise DeltalensError(f"{name} has shape {list(base.shape(name))} in the base but "
                                 f"{list(ckpt.shape(name))} in the checkpoint: is it the right base?")
        yield name, base.get(name), ckpt.get(name)


def _abs_delta_chunks(b: torch.Tensor, c: torch.Tensor):
    """Yield |Δ| (float32) of the changed, finite coordinates, chunk by chunk."""
    b, c = b.reshape(-1), c.reshape(-1)
    for lo in range(0, b.numel(), CHUNK):
        a = (c[lo:lo + CHUNK].float() - b[lo:lo + CHUNK].float()).abs()
        yield a[(a > 0) & torch.isfinite(a)]


def thresholds_for_sparsity(base_src, ckpt_src, targets: Sequence[float]) -> list[float]:
    """Exact global τ for each target sparsity in [0, 1] (see module docstring); sources or paths."""
    for s in targets:
        if not 0 <= s <= 1:
            raise DeltalensError(f"target sparsity {s} is outside [0, 1]; use e.g. 0.5,0.9")
    with open_tensors(base_src) as base, open_tensors(ckpt_src) as ckpt:
        # pass 1: histogram of bit-pattern keys over all changed coordinates
        hist = torch.zeros(_BUCKETS, dtype=torch.int64)
        for _, b, c in _pairs(base, ckpt):
            for a in _abs_delta_chunks(b, c):
                hist += torch.bincount(a.view(torch.int32) >> _SHIFT, minlength=_BUCKETS)
        n = int(hist.sum())
        if n == 0:
            return [0.0 for _ in targets]
        cum = torch.cumsum(hist, 0)                                  # cum[i] = #values with key <= i
        ranks = [max(math.ceil(s * n), 1) - 1 for s in targets]       # 0-based rank of τ in ascending order
        keys = [int(torch.searchsorted(cum, torch.tensor(r), right=True)) for r in ranks]
        wanted = torch.tensor(sorted(set(keys)), dtype=torch.int32)
        # pass 2: collect the values of the wanted buckets only
        found: dict[int, list[torch.Tensor]] = {k: [] for k in wanted.tolist()}
        for _, b, c in _pairs(base, ckpt):
            for a in _abs_delta_chunks(b, c):
                key = a.view(torch.int32) >> _SHIFT
                hit = torch.isin(key, wanted)
                if hit.any():
                    a, key = a[hit], key[hit]
                    for k in torch.unique(key).tolist():
                        found[k].append(a[key == k])
        bucket = {k: torch.sort(torch.cat(v)).values for k, v in found.items()}
    taus = []
    for s, r, k in zip(targets, ranks, keys):
        below = int(cum[k - 1]) if k > 0 else 0                      # values in lower buckets
        taus.append(0.0 if s == 0 else float(bucket[k][r - below]))
    return taus


def apply_threshold(base_sd: dict[str, torch.Tensor], ckpt_sd: dict[str, torch.Tensor],
                    tau: float) -> tuple[dict[str, torch.Tensor], dict]:
    """Reset coordinates with 0 < |Δ| <= tau to the base. Returns (new state dict, stats).

    stats = {"tau", "sparsity", "kept_l2_frac", "n_changed", "n_reset"}; tensors only in the
    checkpoint and non-float tensors are kept as they are; ties in ckpt_sd are preserved.
    """
    if tau < 0 or not math.isfinite(tau):
        raise DeltalensError(f"threshold {tau} must be a finite number >= 0")
    src = DictSource(ckpt_sd)
    alias = {m: g[0] for g in src.tied() for m in g[1:]}
    out: dict[str, torch.Tensor] = {}
    changed = reset = 0
    sq_all = sq_kept = 0.0
    for name, c in ckpt_sd.items():
        if name in alias:
            continue
        b = base_sd.get(name)
        if b is None or not (b.is_floating_point() and c.is_floating_point()):
            out[name] = c
            continue
        if b.shape != c.shape:
            raise DeltalensError(f"{name} has shape {list(b.shape)} in the base but {list(c.shape)} "
                                 "in the checkpoint: is it the right base?")
        d = c.float() - b.float()                                    # Δ in float32, same shape
        a = d.abs()
        fin = torch.isfinite(a)
        ch = (a > 0) & fin
        r = ch & (a <= tau)
        changed += int(ch.sum())
        reset += int(r.sum())
        d = torch.where(fin, d, 0.0)
        sq_all += _sq(d)
        sq_kept += _sq(torch.where(r, 0.0, d))
        out[name] = torch.where(r, b.to(c.dtype), c)
    for name, first in alias.items():
        if first in out:
            out[name] = out[first]                                   # keep the tie
    stats = {"tau": tau, "sparsity": reset / changed if changed else 0.0,
             "kept_l2_frac": math.sqrt(sq_kept / sq_all) if sq_all > 0 else None,
             "n_changed": changed, "n_reset": reset}
    return {k: out[k] for k in ckpt_sd if k in out}, stats


def _deltas(base_sd, ckpt_sd):
    """(name, base, ckpt, Δ float32) of every float tensor both hold, tied names once."""
    alias = {m: g[0] for g in DictSource(ckpt_sd).tied() for m in g[1:]}
    for name, c in ckpt_sd.items():
        b = base_sd.get(name)
        if name in alias or b is None or not (b.is_floating_point() and c.is_floating_point()):
            continue
        if b.shape != c.shape:
            raise DeltalensError(f"{name} has shape {list(b.shape)} in the base but {list(c.shape)} "
                                 "in the checkpoint: is it the right base?")
        yield name, b, c, c.float() - b.float()


def _retie(out: dict, ckpt_sd: dict) -> dict:
    for g in DictSource(ckpt_sd).tied():
        for m in g[1:]:
            if g[0] in out:
                out[m] = out[g[0]]
    return {k: out.get(k, v) for k, v in ckpt_sd.items()}


def random_mask(base_sd: dict[str, torch.Tensor], ckpt_sd: dict[str, torch.Tensor], sparsity: float,
                seed: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """Control for `apply_threshold` at equal sparsity: reset a uniformly random share `sparsity` of the
    changed coordinates (each independently, seeded), whatever their size."""
    if not 0 <= sparsity <= 1:
        raise DeltalensError(f"sparsity must be in [0, 1] (got {sparsity})")
    gen = torch.Generator().manual_seed(seed)
    out, changed, reset, sq_all, sq_kept = {}, 0, 0, 0.0, 0.0
    for name, b, c, d in _deltas(base_sd, ckpt_sd):
        fin = torch.isfinite(d)
        ch = (d != 0) & fin
        r = ch & (torch.rand(d.shape, generator=gen) < sparsity)
        changed, reset = changed + int(ch.sum()), reset + int(r.sum())
        d = torch.where(fin, d, 0.0)
        sq_all += _sq(d)
        sq_kept += _sq(torch.where(r, 0.0, d))
        out[name] = torch.where(r, b.to(c.dtype), c)
    stats = {"control": "random_mask", "sparsity": reset / changed if changed else 0.0,
             "kept_l2_frac": math.sqrt(sq_kept / sq_all) if sq_all > 0 else None, "n_changed": changed,
             "n_reset": reset, "seed": seed}
    return _retie(out, ckpt_sd), stats


def uniform_shrink(base_sd: dict[str, torch.Tensor], ckpt_sd: dict[str, torch.Tensor],
                   scale: float) -> tuple[dict[str, torch.Tensor], dict]:
    """Control for `apply_threshold` at equal norm: θ0 + scale·Δ everywhere (no coordinate is reset), with
    `scale` the thresholded update's kept_l2_frac, so both keep the same ||Δ||."""
    if not 0 <= scale <= 1:
        raise DeltalensError(f"scale must be in [0, 1] (got {scale})")
    out = {}
    for name, b, c, d in _deltas(base_sd, ckpt_sd):
        fin = torch.isfinite(d)
        out[name] = torch.where(fin, (b.float() + scale * torch.where(fin, d, 0.0)).to(c.dtype), c)
    return _retie(out, ckpt_sd), {"control": "uniform_shrink", "kept_l2_frac": scale}


def gain_retained(p: float | None, p_base: float | None, p_full: float | None) -> float | None:
    """(p - p_base) / (p_full - p_base); None when there is no gain to retain or a value is missing."""
    if p is None or p_base is None or p_full is None or p_full - p_base <= 0:
        return None
    return (p - p_base) / (p_full - p_base)


def _pass_at_k(result: dict, what: str) -> dict[str, float]:
    if not isinstance(result, dict) or not isinstance(result.get("pass_at_k"), dict):
        raise DeltalensError(f"the evaluation of {what} returned no pass_at_k; check the task and --k")
    return {str(k): v for k, v in result["pass_at_k"].items()}


def per_problem_pass(result: dict, k: str) -> list[float] | None:
    """Unbiased Pass@k of each problem of an evaluation (from its per-problem correct / n counts), or
    None when the result has no per-problem rows (then no interval can be given)."""
    from deltalens.evaluation.passk import pass_at_k

    rows = result.get("per_problem") if isinstance(result, dict) else None
    kk = int(float(k))
    if not rows or not all(isinstance(r, dict) and isinstance(r.get("n"), int) and isinstance(r.get("correct"), int)
                           and 0 <= r["correct"] <= r["n"] and r["n"] >= kk for r in rows):
        return None
    return [pass_at_k(int(r["n"]), int(r["correct"]), kk) for r in rows]


def gain_interval(base: list[float] | None, full: list[float] | None) -> list[float] | None:
    """95% paired bootstrap interval over problems of mean(full - base), or None without per-problem data."""
    from deltalens.analysis.stats import problem_bootstrap

    if base is None or full is None or len(base) != len(full) or len(base) < 2:
        return None
    return list(problem_bootstrap([full], [base]))


def share_interval(p: list[float] | None, base: list[float] | None, full: list[float] | None) -> list[float] | None:
    """95% interval of the share of the gain kept, (p - base) / (full - base) over problem resamples
    (`stats.gain_ratio`); None without per-problem data or when most resamples have no positive gain."""
    from deltalens.analysis.stats import gain_ratio

    if p is None or base is None or full is None or not len(p) == len(base) == len(full) or len(p) < 2:
        return None
    _, (lo, hi) = gain_ratio([p], [full], [base])
    return None if not (math.isfinite(lo) and math.isfinite(hi)) else [lo, hi]


def sparsify_sweep(base_path, ckpt_path, taus: Sequence[float], evaluate_fn: Callable[[dict], dict],
                   out_dir: str | Path | None = None, *, sparsities: Sequence[float] = (),
                   label: str | None = None, task: str | None = None, evals: dict | None = None,
                   on_start: Callable[[], None] | None = None) -> dict:
    """Evaluate the checkpoint sparsified at each τ (and at the τ of each target sparsity).

    evaluate_fn(state_dict) -> {"pass_at_k": {"1": p, ...}, ...}. Returns the schema's `sparsify`
    section, {label: {"task", "ks", "base_pass_at_k", "full_pass_at_k", "gain_ci", "gain_within_noise",
    "points": [...], "warnings": [...]}} (module docstring), with points sorted by τ. With out_dir, each
    sparsified checkpoint is saved there as `tau-<τ>.safetensors`. Pass a dict as `evals` to receive the
    full evaluation results of the base ("base") and of the unsparsified checkpoint (label), e.g. for the
    schema's `evals` section. `on_start()` is called once both checkpoints are read and checked, before
    the first evaluation (a command states its cost there, so a refused input prints only its error).
    """
    check_points(taus, sparsities)
    base_sd, ckpt_sd = load_state_dict_any(base_path), load_state_dict_any(ckpt_path)
    for sd, path in ((base_sd, base_path), (ckpt_sd, ckpt_path)):  # each is evaluated: it must generate
        check_finite(sd.items(), "the state dict" if isinstance(path, dict) else str(path))
    label = label or default_label(ckpt_path)
    points = [(float(t), None) for t in taus]
    if sparsities:
        points += list(zip(thresholds_for_sparsity(base_sd, ckpt_sd, sparsities), sparsities))
    if on_start is not None:
        on_start()
    base_eval = evaluate_fn(base_sd)
    full_eval = evaluate_fn(ckpt_sd)
    p_base, p_full = _pass_at_k(base_eval, "the base"), _pass_at_k(full_eval, "the checkpoint")
    if evals is not None:
        evals.update({"base": base_eval, label: full_eval})
    ks = sorted(p_full, key=lambda k: float(k))
    head = ks[0] if ks else None                           # the headline K (gain_retained, intervals)
    per_base = per_problem_pass(base_eval, head) if head else None
    per_full = per_problem_pass(full_eval, head) if head else None
    gain_ci = gain_interval(per_base, per_full)
    cache: dict[float, dict] = {}
    out, warnings = [], []
    for tau, target in sorted(points, key=lambda p: (p[0], p[1] is not None)):
        sd, stats = apply_threshold(base_sd, ckpt_sd, tau)
        if stats["n_reset"] == 0:
            result = full_eval                             # nothing reset: the full checkpoint
        elif stats["n_reset"] == stats["n_changed"]:
            result = base_eval                             # every change reset: the base
        else:
            if tau not in cache:
                cache[tau] = evaluate_fn(sd)
            result = cache[tau]
        p = _pass_at_k(result, f"the checkpoint sparsified at tau={tau:g}")
        if out_dir is not None:
            save_state_dict(sd, Path(out_dir) / f"tau-{tau:.6g}.safetensors")
        del sd
        at_k = {k: gain_retained(p.get(k), p_base.get(k), p_full.get(k)) for k in ks}
        point = {"tau": tau, "sparsity": stats["sparsity"], "kept_l2_frac": stats["kept_l2_frac"],
                 "pass_at_k": p, "gain_retained": at_k[head] if ks else None, "gain_retained_at_k": at_k,
                 "gain_retained_ci": None}
        if point["gain_retained"] is not None:
            point["gain_retained_ci"] = share_interval(per_problem_pass(result, head), per_base, per_full)
        if target is not None:
            point["target_sparsity"] = target
        if stats["n_changed"] and stats["sparsity"] >= ALL_RESET:
            warnings.append(f"tau={tau:g} resets {stats['sparsity']:.1%} of the changed coordinates of {label}: "
                            "the sparsified model is (nearly) the base; choose a smaller tau")
        out.append(point)
    return {label: {"task": task, "ks": [int(k) if float(k).is_integer() else float(k) for k in ks],
                    "base_pass_at_k": p_base, "full_pass_at_k": p_full, "gain_ci": gain_ci,
                    "gain_within_noise": None if gain_ci is None else bool(gain_ci[0] <= 0 <= gain_ci[1]),
                    "points": out, "warnings": warnings}}


def sparsify_analysis(base_path, ckpt_path, taus: Sequence[float], evaluate_fn: Callable[[dict], dict], *,
                      sparsities: Sequence[float] = (), label: str | None = None, task: str | None = None,
                      out_dir: str | Path | None = None, on_start: Callable[[], None] | None = None) -> dict:
    """A complete analysis.json document (base, models, evals, sparsify) for one sparsification sweep; the base
    and the checkpoint resolved once here (`deltalens.io.tensors.references`), every later step takes them."""
    label = label or default_label(ckpt_path)
    base_ref, ckpt_ref = references([base_path, ckpt_path])
    evals: dict = {}
    section = sparsify_sweep(base_ref, ckpt_ref, taus, evaluate_fn, out_dir, sparsities=sparsities,
                             label=label, task=task, evals=evals, on_start=on_start)
    return analysis_document(base_path, [model_entry(label, ckpt_ref)], evals=evals, sparsify=section)


def load_state_dict_any(x) -> dict[str, torch.Tensor]:
    """A state dict as-is, or loaded from any checkpoint path / spec."""
    return x if isinstance(x, dict) else load_state_dict(x)
