"""Does "ES changes norm weights most" come from the arithmetic rather than from learning? A reward-free replay.

    python examples/10_arithmetic_replay.py --model smollm2 --iterations 5     # ~16 min on 2 CPU cores (940 s, 2026-12-01)
    python examples/10_arithmetic_replay.py --model smollm2 --iterations 5 --norm-scale 1   # 16 min, 1 core (2026-12-01)
    python examples/10_arithmetic_replay.py --quick                            # seconds (tests; tiny)

No generation and no reward: every iteration draws the population at the paper's settings (N=32,
σ=1.5e-3, α=2.5e-4), perturbs and restores each member exactly as training would, and applies an update
with *random* fitness z (standard normal, the same z for every arithmetic). Whatever structure the
resulting Δ shows is then a property of the arithmetic alone. Four arithmetics on the same weights:

    ours-fp32, ours-bf16      deltalens (a seed per tensor block, fp32 accumulation, exact restore)
    ref-fp32,  ref-bf16       Qiu et al.'s script (one seed per member for every tensor, noise and update
                              in the weight dtype, restore by subtraction): `ESConfig(arithmetic="reference")`

For each: the group composition of the top-100 coordinates by |Δ| and by |Δ|/|θ0|, the rel. L2 of each
parameter group, and the restore drift (how far the weights are from where they started after all
members of an iteration were perturbed and restored, before the update). Hypothesis under test
(arXiv 2608.27351's "ES's top changes sit in norm weights"): the bf16 restore drift and the correlated
noise, not learning, put the norm weights on top. Writes <out>/10_arithmetic_replay.json; each
arithmetic's result is kept in <out>/10_arithmetic_replay.parts/ as it finishes, and the same command reuses it
(with the same settings and the same code: `code_fingerprint`).

`--norm-scale M` first reparametrizes the model, without changing its function, so that every RMSNorm
weight vector has median |g| = M: each decoder layer's norm weight g is multiplied by c = M / median|g|
and the input columns of the matrices that read its output (q/k/v after input_layernorm, gate/up after
post_attention_layernorm) are divided by c, since RMSNorm(x) * g * c fed to W / c gives the same product.
The final norm is folded into the LM head only when the head is not tied to the embedding (SmolLM2's is
tied: its final norm stays as it is). The drift mechanism under test scales with |θ| (one bf16 step is
proportional to the weight), and SmolLM2's norm weights are small (median 0.27); M = 1 puts them where
Qwen2.5 / Llama norm weights sit, beside matrices that shrink by the same c. The script checks that the
logits did not change (fp32, one prompt) and records the check.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

ARITHMETICS = {"ours-fp32": ("deltalens", "fp32"), "ours-bf16": ("deltalens", "bf16"),
               "ref-fp32": ("reference", "fp32"), "ref-bf16": ("reference", "bf16")}


def code_fingerprint() -> str:
    """sha256 (16 hex digits) of the source that decides a replay's numbers: this script, every module of the ES
    package (noise, seeds, perturb/restore, update), the bf16 copy's rules, model loading and the diff. A kept
    part is reused only under the same code, so a change there never mixes old and new results in one table."""
    import hashlib

    import deltalens
    from deltalens.training import es

    root = Path(deltalens.__file__).parent
    files = [Path(__file__), *sorted(Path(es.__file__).parent.glob("*.py")),
             *(root / f for f in ("analysis/delta.py", "generation/dtype.py", "io/models.py"))]
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() if f.is_relative_to(root) else f.name.encode())
        h.update(b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


# Which matrices read each RMSNorm's output (Llama / Qwen2 / SmolLM2 layout).
NORM_CONSUMERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}


def fold_norm_scale(model, median: float) -> dict:
    """Scale every norm weight to the given median |g| and divide its consumers' input columns by the
    same factor (in place, fp32). Returns the range of the factors and of the norms' median |g| before."""
    import torch

    from deltalens.errors import DeltalensError

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise DeltalensError("--norm-scale needs a Llama-style model (model.model.layers)")

    def median_abs(name: str, g) -> float:
        m = float(g.abs().median())
        if not m > 0:
            raise DeltalensError(f"--norm-scale: {name} has median |g| {m}, cannot rescale")
        return m

    factors, before = [], []
    with torch.no_grad():
        for layer in layers:
            for norm_name, consumers in NORM_CONSUMERS.items():
                g = layer.get_submodule(norm_name).weight
                before.append(median_abs(norm_name, g))
                c = median / before[-1]
                g.mul_(c)
                for name in consumers:
                    layer.get_submodule(name).weight.div_(c)  # (out, in): column j reads g_j
                factors.append(c)
        final = model.model.norm.weight
        tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        final_factor = 1.0
        if not tied:
            final_factor = median / median_abs("model.norm", final)
            final.mul_(final_factor)
            model.lm_head.weight.div_(final_factor)
    return {"median": median, "factor_min": min(factors), "factor_max": max(factors),
            "median_before_min": min(before), "median_before_max": max(before),
            "final_norm_folded": not tied, "final_norm_factor": final_factor}


def load_replay_model(model_spec: str, dtype: str, norm_scale: float | None):
    """The model to replay on, in `dtype`; with `norm_scale`, reparametrized in fp32 first (then cast), and
    the logits checked against the original's."""
    import torch

    from deltalens.io.models import load_model

    if norm_scale is None:
        model, tok = load_model(model_spec, dtype=dtype)
        return model, tok, None
    model, tok = load_model(model_spec, dtype="fp32")
    ids = tok("12+7=19. 3+45=", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = model(ids).logits
        info = fold_norm_scale(model, norm_scale)
        new = model(ids).logits
    info["logits_max_rel_diff"] = float((new - ref).abs().max() / ref.abs().max())
    if not info["logits_max_rel_diff"] < 1e-4:
        raise RuntimeError(f"--norm-scale changed the model's function: {info['logits_max_rel_diff']:.2e}")
    if dtype != "fp32":
        model.to(torch.bfloat16)
    return model, tok, info


def _snapshot(params, exact: bool) -> dict:
    """The trained tensors at the start of an iteration: clones where the restore can drift (subtraction),
    else a per-tensor digest (restore by copy: whether every bit came back is all there is to measure, and
    a second full copy beside the engine's own restore copy would not fit a 1.5B model in 24 GiB)."""
    if exact:
        return {n: p.detach().clone() for _, n, p in params}
    return {n: _digest(p) for _, n, p in params}


def _digest(p) -> bytes:
    """blake2b of a tensor's bytes."""
    import hashlib

    import torch

    return hashlib.blake2b(p.detach().contiguous().view(-1).view(torch.uint8).numpy(), digest_size=16).digest()


def _drift(params, start: dict) -> tuple[float, int, int]:
    """(max |θ - θ_start|, coordinates changed, coordinates) over the trained tensors; from digests only
    bit-identical tensors can be told (a changed one is reported as drift NaN, never as 0)."""
    worst, changed, total = 0.0, 0, 0
    for _, n, p in params:
        total += p.numel()
        ref = start[n]
        if isinstance(ref, bytes):
            if _digest(p) != ref:
                return float("nan"), -1, total
            continue
        d = (p.detach().float() - ref.float()).abs()
        worst = max(worst, float(d.max()))
        changed += int((d > 0).sum())
    return worst, changed, total


def replay(model_spec: str, arithmetic: str, dtype: str, iterations: int, population: int, seed: int,
           norm_scale: float | None = None) -> dict:
    """One arithmetic replayed; memory: the model, the engine's restore copy (restore by copy) or one start
    snapshot (subtraction), then the final weights beside the reloaded base (never three full copies)."""
    import gc

    from deltalens.analysis.delta import diff_checkpoints
    from deltalens.tasks import get_task
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.engine import ESEngine, new_timing

    model, tok, folded = load_replay_model(model_spec, dtype, norm_scale)
    restore = "subtract" if arithmetic == "reference" else "copy"
    cfg = ESConfig(population=population, sigma=1.5e-3, alpha=2.5e-4, arithmetic=arithmetic, seed=seed,
                   restore=restore, dtype=dtype, prompts_per_iteration=1)
    eng = ESEngine(model, tok, get_task("arith"), cfg)
    rng = random.Random(f"replay-fitness/{seed}")
    drift_max, drift_frac = 0.0, 0.0
    for it in range(1, iterations + 1):
        start = _snapshot(eng.params, exact=restore == "subtract")
        timing = new_timing()
        t0 = time.perf_counter()
        for m in range(population):
            eng.perturb(it, m, timing)
            eng.restore(it, m, timing)
            if (m + 1) % 8 == 0 or m + 1 == population:  # a 1.5B model takes minutes per iteration
                C.log(f"  {arithmetic}-{dtype} iteration {it}/{iterations}: {m + 1}/{population} members, "
                      f"{time.perf_counter() - t0:.0f} s")
        worst, changed, total = _drift(eng.params, start)
        del start
        # a digest mismatch (NaN, -1) stays NaN for the whole replay: never reported as a number
        drift_max = worst if math.isnan(worst) or math.isnan(drift_max) else max(drift_max, worst)
        drift_frac = float("nan") if changed < 0 or math.isnan(drift_frac) else max(drift_frac, changed / total)
        z = [rng.gauss(0, 1) for _ in range(population)]
        mean = sum(z) / population
        std = (sum((x - mean) ** 2 for x in z) / population) ** 0.5
        eng.update(it, [(x - mean) / std for x in z])
    eng.close()
    del eng
    gc.collect()  # the engine's restore copy goes before the base is loaded again
    base, _, _ = load_replay_model(model_spec, dtype, norm_scale)  # the same weights, loaded (and folded) again
    # the diff reduces any float dtype in fp32 chunks; the state dicts keep tied tensors tied
    d = diff_checkpoints(base.state_dict(), [model.state_dict()], ["replay"], progress=False)["diff"]["replay"]
    del model, base
    gc.collect()
    return {"arithmetic": arithmetic, "dtype": dtype, "iterations": iterations, "population": population,
            "restore_drift_max": drift_max, "restore_drift_frac": drift_frac,
            "top_abs": d["topk"]["abs"]["composition"], "top_rel": d["topk"]["rel"]["composition"],
            "rel_l2": {g: m["rel_l2"] for g, m in d["groups"].items()}, "whole_rel_l2": d["whole"]["rel_l2"],
            "norm_scale": folded}


def main(argv=None) -> dict:
    ap = C.parser(__doc__, seeds="0")
    ap.add_argument("--iterations", type=int, default=None, help="replayed iterations (default 5, quick 1)")
    ap.add_argument("--population", type=int, default=None, help="members per iteration (default 32, quick 4)")
    ap.add_argument("--arithmetics", default=",".join(ARITHMETICS),
                    help="which to replay, comma-separated, in this order (default: all four; on a 1.5B model the "
                         "reference ones took ~25 min each on one core, 2026-12-05)")
    ap.add_argument("--norm-scale", type=float, default=None, metavar="M",
                    help="first reparametrize the model (same function) so every norm weight has median |g| M")
    args = ap.parse_args(argv)
    if args.norm_scale is not None and not args.norm_scale > 0:
        ap.error(f"--norm-scale must be > 0, got {args.norm_scale}")
    chosen = [a.strip() for a in args.arithmetics.split(",") if a.strip()]
    unknown = [a for a in chosen if a not in ARITHMETICS]
    if unknown or not chosen:
        ap.error(f"--arithmetics: unknown {', '.join(unknown) or '(none given)'}; use {', '.join(ARITHMETICS)}")
    iterations = args.iterations or (1 if args.quick else 5)
    population = args.population or (4 if args.quick else 32)
    seed = C.seeds_of(args)[0]
    results = {}
    # each arithmetic's result is kept as it finishes (a 1.5B model took 10-26 min per arithmetic and iteration):
    # the same command skips the ones done with the same settings
    key = {"model": args.model, "iterations": iterations, "population": population, "seed": seed,
           "norm_scale": args.norm_scale, "code": code_fingerprint()}
    for name in chosen:
        arithmetic, dtype = ARITHMETICS[name]
        done = Path(args.out) / "10_arithmetic_replay.parts" / f"{name}.json"
        kept = json.loads(done.read_text()) if done.is_file() else {}
        kept = kept if isinstance(kept, dict) and isinstance(kept.get("key"), dict) else {}
        if kept.get("key") == key:
            print(f"{name}: done before ({done}), reused", flush=True)
            results[name] = kept["result"]
            continue
        if kept and kept["key"].get("code") != key["code"]:
            print(f"{name}: kept part {done} is from other code, replayed anew", flush=True)
        print(f"{name}: {iterations} iterations x {population} members", flush=True)
        results[name] = replay(args.model, arithmetic, dtype, iterations, population, seed, args.norm_scale)
        done.parent.mkdir(parents=True, exist_ok=True)
        tmp = done.with_suffix(".tmp")  # written whole, then renamed: a killed run leaves no half file
        tmp.write_text(json.dumps({"key": key, "result": results[name]}, indent=1, default=str))
        tmp.replace(done)
    groups = sorted({g for r in results.values() for g in (*r["top_abs"], *r["top_rel"])})
    rows = [[name, f"{r['restore_drift_max']:.2e}", f"{r['restore_drift_frac']:.2f}",
             *[str(r["top_abs"].get(g, 0)) for g in groups], *[str(r["top_rel"].get(g, 0)) for g in groups]]
            for name, r in results.items()]
    header = ["arithmetic", "restore drift max", "share drifted", *[f"|Δ| {g}" for g in groups],
              *[f"|Δ|/|θ0| {g}" for g in groups]]
    md = "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
                   + ["| " + " | ".join(r) + " |" for r in rows])
    result = {"model": args.model, "iterations": iterations, "population": population, "seed": seed,
              "norm_scale": args.norm_scale, "results": results}
    C.save(args.out, "10_arithmetic_replay", result, md)
    return result


if __name__ == "__main__":
    main()
