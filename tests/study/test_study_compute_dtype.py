"""The study's Pass@K and sparsity evaluations generate in --compute-dtype (default auto), and their cache keys
name it when it is not fp32, so results cached in fp32 (every study before the option) still count and a
bf16 result is never taken for an fp32 one."""

from __future__ import annotations

import pytest
from support import tiny_spec

from deltalens.errors import DeltalensError
from deltalens.generation import dtype as cd
from deltalens.study.config import StudyConfig
from deltalens.study.measures import Measures


def measures(tmp_path, **kw):
    return Measures(StudyConfig(model=tiny_spec(), task="arith", limit=2, samples=2, k=(1, 2), **kw), tmp_path,
                    log=lambda s: None)


def test_keys_name_the_compute_dtype_only_when_it_is_not_fp32(tmp_path, monkeypatch):
    monkeypatch.setattr(cd, "cpu_flags", lambda: frozenset({"amx_bf16"}))  # bf16 fast: auto still keeps tiny fp32
    fp32, auto, bf16 = (measures(tmp_path, compute_dtype=c) for c in ("fp32", "auto", "bf16"))
    assert fp32.compute_key(tiny_spec()) == auto.compute_key(tiny_spec()) == {}
    assert bf16.compute_key(tiny_spec()) == {"compute": "bf16"}
    keys = [m.evaluation_key(tiny_spec(), 0, 0.6)[0] for m in (fp32, auto, bf16)]
    assert keys[0] == keys[1] != keys[2]


def test_a_bf16_study_evaluation_generates_in_bf16(tmp_path):
    ev, path = measures(tmp_path, compute_dtype="bf16").evaluation(tiny_spec(), "base", 0, 0.6)
    assert ev["compute_dtype"] == "bf16" and (tmp_path / path).is_file()
    ev32, path32 = measures(tmp_path, compute_dtype="fp32").evaluation(tiny_spec(), "base", 0, 0.6)
    assert ev32["compute_dtype"] == "fp32" and path32 != path


def test_bf16_compute_on_vllm_is_refused():
    with pytest.raises(DeltalensError, match="--compute-dtype bf16 is the HF backend's"):
        StudyConfig(model="tiny", compute_dtype="bf16", backend="vllm")
    with pytest.raises(DeltalensError, match="--compute-dtype must be one of auto, fp32, bf16"):
        StudyConfig(model="tiny", compute_dtype="fp16")
