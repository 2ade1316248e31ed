"""GPU check of the HF (transformers) path: the same commands on the CPU and on one CUDA GPU.

    PYTHONPATH=. python benchmarks/gpu_hf_check.py --out OUT_DIR [--budget 420]

What it measures, each step under the time budget (a failed step is recorded, the others still run):
  env        torch / transformers versions, the GPU, and whether vLLM imports (benchmarks/gpu_check.sh
             needs it; this script does not)
  eval       `evaluate_models(["tiny"], arith, 200 problems x 32 samples, T=0.6)` with device=cpu and
             device=cuda: Pass@1/16/32, Maj@32 and completion characters/s (tiny is char-level, so
             characters ~ tokens). The sampling streams differ between devices, so Pass@K agrees within
             its sampling error, not exactly.
  es         2 ES iterations (tiny preset, N=8, 8 prompts, greedy) on the CPU and on the GPU from the same
             seeds: member rewards per iteration and the final weights compared element by element
             (max |Δθ| and ||θ_cpu - θ_gpu|| / ||θ_cpu - θ_0||: how much of the update the devices disagree on).
  throughput `benchmarks/bench_es_throughput.py --device cuda` (pure batched inference vs the ES paths).
Prints one JSON object and writes it to OUT_DIR/gpu_hf_check.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def step_env() -> dict:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.cuda.is_available(), "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    try:
        import vllm

        out["vllm"] = vllm.__version__
    except Exception as e:  # noqa: BLE001 - reported, not raised
        out["vllm"] = f"not importable: {type(e).__name__}: {e}"[:200]
    return out


def step_eval(limit: int, samples: int) -> dict:
    from deltalens.evaluation import evaluate_models
    from deltalens.tasks import get_task

    out = {}
    for device in ("cpu", "cuda"):
        t0 = time.time()
        r = evaluate_models(["tiny"], get_task("arith"), samples=samples, ks=(1, 16, 32), limit=limit,
                            device=device)
        e = r["evals"]["tiny"]
        out[device] = {"pass_at_k": e["pass_at_k"], "maj_at_k": e["maj_at_k"], "mean_reward": e["mean_reward"],
                       "generate_s": e["timing"]["generate_s"],
                       "chars_per_s": e["timing"]["completion_chars_per_s"], "wall_s": round(time.time() - t0, 1)}
    p1 = [out[d]["pass_at_k"]["1"] for d in ("cpu", "cuda")]
    n = limit * samples
    se = math.sqrt(max(p1[0] * (1 - p1[0]), 1e-9) / n) * math.sqrt(2)
    out["pass1_diff"] = p1[1] - p1[0]
    out["pass1_diff_in_se"] = (p1[1] - p1[0]) / se
    out["speedup_cuda_over_cpu"] = out["cuda"]["chars_per_s"] / out["cpu"]["chars_per_s"]
    return out


def step_es(work: Path, iterations: int) -> dict:
    import torch

    from deltalens.io.runs import RunDir
    from deltalens.io.tensors import open_tensors
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.train import train_es

    out, weights = {}, {}
    for device in ("cpu", "cuda"):
        cfg = ESConfig.preset("tiny", model="tiny", population=8, prompts_per_iteration=8, iterations=iterations,
                              eval_every=0, checkpoint_every=0, seed=0, device=device)
        run = work / f"es-{device}"
        t0 = time.time()
        train_es(cfg, run, overwrite=True)
        rows = [m for m in RunDir(run).metrics() if "rewards" in m or "reward_mean" in m]
        out[device] = {"seconds": round(time.time() - t0, 1),
                       "rewards": [m.get("rewards") for m in rows], "reward_mean": [m.get("reward_mean") for m in rows]}
        with open_tensors(run) as src:
            weights[device] = {n: src.get(n).float() for n in src.names()}
    with open_tensors("tiny") as src:
        base = {n: src.get(n).float() for n in src.names()}
    num = sum(float((weights["cpu"][n] - weights["cuda"][n]).double().square().sum()) for n in base)
    upd = sum(float((weights["cpu"][n] - base[n]).double().square().sum()) for n in base)
    out["max_abs_weight_diff"] = max(float((weights["cpu"][n] - weights["cuda"][n]).abs().max()) for n in base)
    out["disagreement_over_update_l2"] = math.sqrt(num / upd) if upd > 0 else None
    out["same_rewards"] = out["cpu"]["rewards"] == out["cuda"]["rewards"]
    out["bitwise_equal"] = all(torch.equal(weights["cpu"][n], weights["cuda"][n]) for n in base)
    return out


def step_throughput(seconds: int) -> dict:
    script = ROOT / "benchmarks" / "bench_es_throughput.py"
    if not script.exists():
        return {"skipped": "benchmarks/bench_es_throughput.py not present"}
    r = subprocess.run([sys.executable, str(script), "--model", "tiny", "--device", "cuda"], check=False, capture_output=True,
                       text=True, timeout=seconds, cwd=ROOT)
    if r.returncode != 0:
        return {"rc": r.returncode, "stderr_tail": r.stderr[-1500:]}
    return json.loads(r.stdout[r.stdout.index("{"):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu_hf_check_out"))
    ap.add_argument("--budget", type=int, default=420, help="seconds for all steps")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--steps", default="env,eval,es,throughput")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    result = {"steps": {}}
    plan = {"env": lambda: step_env(), "eval": lambda: step_eval(args.limit, args.samples),
            "es": lambda: step_es(args.out / "runs", 2),
            "throughput": lambda: step_throughput(max(30, int(args.budget - (time.time() - t_start) - 20)))}
    for name in args.steps.split(","):
        left = args.budget - (time.time() - t_start)
        if left < 30:
            result["steps"][name] = {"skipped": "time budget spent"}
            continue
        t0 = time.time()
        try:
            result["steps"][name] = plan[name]()
        except Exception as e:  # noqa: BLE001 - one failed step must not hide the others
            result["steps"][name] = {"error": f"{type(e).__name__}: {e}"[:500],
                                     "traceback": traceback.format_exc()[-2000:]}
        result["steps"][name]["step_s"] = round(time.time() - t0, 1)
        print(f"[gpu_hf_check] {name} done in {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
        (args.out / "gpu_hf_check.json").write_text(json.dumps(result, indent=2, default=str))
    result["total_s"] = round(time.time() - t_start, 1)
    text = json.dumps(result, indent=2, default=str)
    (args.out / "gpu_hf_check.json").write_text(text)
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
