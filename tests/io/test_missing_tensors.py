"""A checkpoint that lacks, adds or reshapes a tensor relative to its architecture is refused at load
(issue #36, item 2), in every command, before any work: an HF directory like a bare file. Without the
check transformers fills a missing tensor with random values and every command runs on them."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import run_cli, small_llama, tiny_spec

from deltalens.errors import DeltalensError
from deltalens.io.models import load_model
from deltalens.tiny import MODEL_DIR

GONE = "model.layers.1.mlp.up_proj.weight"
EXTRA = "model.layers.1.mlp.extra_proj.weight"
FAST_EVAL = ["--limit", "2", "-n", "1", "--k", "1", "--max-new-tokens", "4"]


def _edited_copy(dst: Path, edit) -> Path:
    """A copy of the tiny model directory whose model.safetensors went through `edit(state_dict)`."""
    tiny_spec()
    shutil.copytree(MODEL_DIR, dst)
    sd = load_file(dst / "model.safetensors")
    edit(sd)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture
def lacking(tmp_path) -> Path:
    return _edited_copy(tmp_path / "lacking", lambda sd: sd.pop(GONE))


@pytest.fixture
def adding(tmp_path) -> Path:
    return _edited_copy(tmp_path / "adding", lambda sd: sd.__setitem__(EXTRA, torch.zeros(4, 4)))


def _digest(d: Path) -> dict[str, str]:
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*")) if f.is_file()}


def test_load_model_names_the_missing_and_the_extra_tensor(lacking, adding):
    with pytest.raises(DeltalensError) as e:
        load_model(str(lacking))
    assert str(e.value) == (f"{lacking} does not match its architecture (LlamaForCausalLM): missing {GONE}; "
                            "it would run with randomly initialized or ignored weights")
    with pytest.raises(DeltalensError) as e:
        load_model(str(adding))
    assert str(e.value) == (f"{adding} does not match its architecture (LlamaForCausalLM): unexpected {EXTRA}; "
                            "it would run with randomly initialized or ignored weights")


def test_a_reshaped_tensor_is_named_too(tmp_path):
    d = _edited_copy(tmp_path / "reshaped", lambda sd: sd.__setitem__("model.norm.weight", torch.ones(7)))
    with pytest.raises(DeltalensError, match=r"shape mismatch for model\.norm\.weight: file \(7,\) vs model \(128,\)"):
        load_model(str(d))


def test_complete_checkpoints_still_load(tmp_path):
    """Legitimately absent tensors are not reported: a tied lm_head.weight (not saved) and the rotary
    inv_freq buffer (never in a checkpoint)."""
    model, tok = small_llama(tied=True)
    model.save_pretrained(tmp_path / "tied")
    tok.save_pretrained(tmp_path / "tied")
    assert "lm_head.weight" not in load_file(tmp_path / "tied" / "model.safetensors")
    loaded, _ = load_model(str(tmp_path / "tied"))
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    load_model("tiny")


def test_a_bare_file_is_refused_with_the_same_names(tmp_path):
    tiny_spec()
    sd = load_file(MODEL_DIR / "model.safetensors")
    sd.pop(GONE)
    save_file(sd, tmp_path / "x.safetensors")
    with pytest.raises(DeltalensError, match=f"does not match the architecture: missing {GONE}; pass the right --arch"):
        load_model(str(tmp_path / "x.safetensors"), config="tiny")


@pytest.mark.parametrize("which", ["lacking", "adding"])
@pytest.mark.parametrize("command", ["eval", "probe", "diversity", "train-es", "study"])
def test_every_command_refuses_before_any_work(which, command, request, tmp_path):
    model = request.getfixturevalue(which)
    name = GONE if which == "lacking" else EXTRA
    before = _digest(model)
    out = tmp_path / "out"
    args = {
        "eval": ["eval", model, *FAST_EVAL, "--json", out / "e.json"],
        "probe": ["probe", model, "--limit", "2", "-n", "2", "-G", "2", "--es-populations", "0",
                  "--json", out / "p.json"],
        "diversity": ["diversity", model, "-N", "2", "-p", "1", "-n", "1", "--json", out / "d.json"],
        "train-es": ["train", "es", "--model", model, "--out", out, "--iterations", "1", "--population", "2",
                     "--prompts", "2", "--eval-every", "0"],
        "study": ["study", model, "--out", out, "--methods", "es", "--seeds", "0", "--preset", "tiny",
                  "--budget", "4096"],
    }[command]
    r = run_cli(args)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2, r
    # one error line, the last (eval and study may print their cost estimate first), naming the tensor
    assert lines and lines[-1].startswith("error: ") and name in lines[-1], r.output
    assert sum(ln.startswith("error") for ln in lines) == 1 and "Traceback" not in r.output, r.output
    assert "newly initialized" not in r.output and "LOAD REPORT" not in r.output
    assert not out.exists(), sorted(out.rglob("*"))  # no run directory, no study.json, no output file
    assert _digest(model) == before
