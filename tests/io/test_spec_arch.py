"""`--arch` resolved once into a reference (`deltalens.io.spec.resolve_arch`) and carried by the bare
inputs it applies to: `architecture` / `arch_for` hand that reference on without parsing a spec again."""

from __future__ import annotations

import pytest

import deltalens.io.spec as spec_mod
from deltalens.errors import DeltalensError
from deltalens.io.atomic import save_state_dict
from deltalens.io.spec import ModelRef, arch_for, architecture, check_arch, resolve, resolve_arch
from deltalens.tiny import MODEL_DIR


@pytest.fixture
def bare(tmp_path):
    import torch

    return save_state_dict({"w": torch.zeros(2)}, tmp_path / "w.safetensors")


def test_resolve_arch_is_the_checked_spec_resolved(bare):
    ref = resolve_arch("tiny")
    assert isinstance(ref, ModelRef) and ref.kind == "hf_dir" and ref.spec == check_arch("tiny") == "tiny"
    by_file = resolve_arch(str(MODEL_DIR / "config.json"))  # a config.json stands for its directory
    assert by_file.spec == check_arch(str(MODEL_DIR / "config.json")) == str(MODEL_DIR)
    assert resolve_arch(None) is None and check_arch(None) is None
    assert resolve_arch(ref) is ref  # a reference is taken as it is
    with pytest.raises(DeltalensError, match="bare weights file"):
        resolve_arch(str(bare))
    with pytest.raises(DeltalensError, match="bare weights file"):
        resolve_arch(resolve(str(bare)))


def test_a_bare_input_carries_the_arch_reference_and_nothing_is_parsed_again(bare, monkeypatch):
    arch = resolve_arch("tiny")
    ref = resolve(str(bare), arch=arch)
    assert ref.arch is arch
    calls = []
    classify = spec_mod._classify
    monkeypatch.setattr(spec_mod, "_classify", lambda spec, fetch: calls.append(spec) or classify(spec, fetch))
    assert architecture(ref) is arch and arch_for(ref) is arch
    assert architecture(ref, arch) is arch  # an explicit reference: checked, not re-parsed
    assert arch_for(resolve_arch("tiny")) is None  # an input with its own architecture
    assert calls == ["tiny"]  # only the explicit resolve_arch above
    # a spec string as arch still works as before (checked: the spec back)
    assert architecture(resolve(str(bare)), "tiny") == "tiny"


def test_a_reference_prints_as_its_spec(bare):
    ref = resolve(str(bare), arch=resolve_arch("tiny"))
    assert str(ref) == str(bare) and f"--arch {ref.arch}" == "--arch tiny"
