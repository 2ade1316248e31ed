"""Loader round-trips for every model form, and clear errors (exit 2) for bad input."""

import inspect
import pickle
import shutil
import sys

import pytest
import torch
from typer.testing import CliRunner

from deltalens.errors import DeltalensError
from deltalens.io.atomic import save_state_dict
from deltalens.io.models import load_model
from deltalens.io.spec import resolve


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _perturbed(model):
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for v in sd.values():
        v.add_(0.01)
    return sd


def test_bundled_tiny_model_loads():
    model, tok = load_model("tiny")
    n = sum(p.numel() for p in model.parameters())
    assert 500_000 <= n <= 3_000_000
    names = set(model.state_dict())
    # every parameter group the analyses talk about exists, embeddings untied
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight"} <= names
    assert model.model.embed_tokens.weight.data_ptr() != model.lm_head.weight.data_ptr()
    assert tok.decode(tok("Q: 1+2=?\nA:")["input_ids"]) == "Q: 1+2=?\nA:"


def test_hf_dir_and_sharded(rand_model_dir, tmp_path):
    base, _ = load_model(str(rand_model_dir))
    sharded = tmp_path / "sharded"
    base.save_pretrained(sharded, max_shard_size="20KB")
    shutil.copy(rand_model_dir / "tokenizer.json", sharded)
    shutil.copy(rand_model_dir / "tokenizer_config.json", sharded)
    assert (sharded / "model.safetensors.index.json").exists()
    again, _ = load_model(str(sharded))
    assert _same(base, again)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_bare_weights_onto_config(rand_model_dir, tmp_path, suffix):
    base, _ = load_model(str(rand_model_dir))
    sd = _perturbed(base)
    f = tmp_path / f"w{suffix}"
    save_state_dict(sd, f)
    model, _ = load_model(str(f), config=str(rand_model_dir))
    assert all(torch.equal(model.state_dict()[k], sd[k]) for k in sd)
    with pytest.raises(DeltalensError, match="--arch"):
        load_model(str(f))  # no config.json beside it
    from deltalens.io.models import load_config

    assert load_config(str(f), config=str(rand_model_dir)).to_dict() == base.config.to_dict()
    with pytest.raises(DeltalensError, match="--arch"):
        load_config(str(f))


def test_bf16_dtype(rand_model_dir):
    model, _ = load_model(str(rand_model_dir), dtype="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(DeltalensError, match="dtype"):
        load_model(str(rand_model_dir), dtype="fp8")


def test_gguf_without_the_gguf_package_says_what_to_install(tmp_path, monkeypatch):
    from deltalens.cli.main import app

    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")  # never read: the missing package is reported first
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(DeltalensError, match=r"needs the gguf package: pip install 'deltalens\[gguf\]'"):
        load_model(str(f))
    r = CliRunner().invoke(app, ["eval", str(f), "--limit", "1", "--samples", "1", "--k", "1"])
    assert r.exit_code == 2 and "needs the gguf package" in r.output and "tokenizer" not in r.output


def test_gguf_smollm2(smollm2):
    from deltalens.io.models import load_config

    config = load_config(str(smollm2))  # from the GGUF's header, without the weights
    assert (config.model_type, config.tie_word_embeddings, config.num_hidden_layers) == ("llama", True, 30)
    model, tok = load_model(str(smollm2))
    assert model.config.model_type == "llama"
    assert sum(p.numel() for p in model.parameters()) > 100e6
    ids = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_a_gguf_is_loaded_asking_for_dequantized_weights(smollm2, monkeypatch):
    """transformers >= 5.25 keeps GGUF weights packed in their quantized blocks for the architectures its new
    loader covers (lfm2, qwen3.5 in 5.25), after looking up a matmul kernel on the hub; deltalens asks for the
    dequantized model (GgufConfig(dequantize=True)) so that no later transformers can hand ES, diff or
    sparsify packed weights, and no kernel is looked up."""
    transformers = pytest.importorskip("transformers")
    if "dequantize" not in inspect.signature(transformers.GgufConfig.__init__).parameters:
        pytest.skip("this transformers always dequantizes")
    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("quantization_config"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    model, _ = load_model(str(smollm2), dtype="bf16")
    assert len(seen) == 1 and isinstance(seen[0], transformers.GgufConfig) and seen[0].dequantize is True
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert len(linears) == 211 and all(m.weight.dtype == torch.bfloat16 for m in linears)


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_bad_inputs(rand_model_dir, tmp_path):
    with pytest.raises(DeltalensError, match="no such file"):
        load_model(str(tmp_path / "missing.pt"))
    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as f:
        pickle.dump({"w": _Evil()}, f)
    with pytest.raises(DeltalensError, match="weights_only"):
        load_model(str(evil), config=str(rand_model_dir))
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(DeltalensError, match="corrupt.safetensors"):
        load_model(str(corrupt), config=str(rand_model_dir))
    wrong = tmp_path / "wrong.pt"
    save_state_dict({"model.embed_tokens.weight": torch.zeros(3, 3)}, wrong)
    with pytest.raises(DeltalensError, match="does not match"):
        load_model(str(wrong), config=str(rand_model_dir))
    base, _ = load_model(str(rand_model_dir))
    sd = base.state_dict()
    sd["model.norm.weight"] = torch.zeros(7)
    shape = tmp_path / "shape.pt"
    save_state_dict(sd, shape)
    with pytest.raises(DeltalensError, match="shape mismatch for model.norm.weight"):
        load_model(str(shape), config=str(rand_model_dir))
    empty = tmp_path / "emptydir"
    empty.mkdir()
    with pytest.raises(DeltalensError, match="without config.json"):
        load_model(str(empty))
    notok = tmp_path / "notok"
    base.save_pretrained(notok)
    with pytest.raises(DeltalensError, match="tokenizer"):
        load_model(str(notok))
    assert resolve("someorg/somemodel").kind == "hub"


def test_hub_id_offline_is_a_clear_error():
    # a subprocess, because huggingface_hub reads HF_HUB_OFFLINE once, at import
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "deltalens.cli.main", "eval", "deltalens-test/not-a-model"],
                       env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, r.stderr
    assert "deltalens-test/not-a-model" in r.stderr and "Traceback" not in r.stderr


def test_cli_eval_bad_input_exits_2(tmp_path):
    from deltalens.cli.main import app

    r = CliRunner().invoke(app, ["eval", str(tmp_path / "nope.pt")])
    assert r.exit_code == 2
    assert "no such file" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["eval", "tiny", "--k", "64"])  # no K fits (one that fits is reported, with a note)
    assert r.exit_code == 2 and "exceeds --samples" in r.output


def test_gguf_model_can_be_saved_as_hf_checkpoint(smollm2, tmp_path):
    """Training from the GGUF writes HF checkpoints: the dequantised model must be serialisable."""
    model, tok = load_model(str(smollm2))
    model.save_pretrained(tmp_path / "ck", safe_serialization=True)
    tok.save_pretrained(tmp_path / "ck")
    again, _ = load_model(str(tmp_path / "ck"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(again.state_dict()[name], model.state_dict()[name])


def test_device_resolution():
    from deltalens.io.models import resolve_device

    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(DeltalensError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeltalensError, match="no CUDA GPU is visible"):
            resolve_device("cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU-only machine gives")
def test_cli_eval_cuda_without_gpu_exits_2():
    from deltalens.cli.main import app

    r = CliRunner().invoke(app, ["eval", "tiny", "--limit", "1", "--samples", "1", "--k", "1", "--device", "cuda"])
    assert r.exit_code == 2 and "no CUDA GPU is visible" in r.output
