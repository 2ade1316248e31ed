"""The claim-3 sweep (`study.sparsity.sparsity_task`) holds one modified copy of the weights at a time: each
evaluation sees only its own thresholded / masked / shrunk copy alive (three per target, and the next
target's made before the last one's were freed, took Qwen2.5-0.5B's study past 24 GB)."""

from __future__ import annotations

import types
import weakref

import torch
from support import tiny_spec

from deltalens.analysis import sparsify
from deltalens.io.tensors import open_tensors
from deltalens.study import sparsity as sparsity_mod
from deltalens.study.config import StudyConfig
from deltalens.study.executor import TaskContext


def test_one_modified_copy_alive_per_evaluation(tmp_path, monkeypatch):
    with open_tensors(tiny_spec()) as src:
        base = {n: src.get(n) for n in src.names()}
    g = torch.Generator().manual_seed(0)
    run = {n: t + 0.01 * torch.randn(t.shape, generator=g) if t.is_floating_point() else t for n, t in base.items()}
    monkeypatch.setattr(sparsity_mod, "RunDir", lambda spec: types.SimpleNamespace(weights=lambda: run))

    made: list[weakref.ref] = []  # one fresh tensor of each modified copy

    def tracked(fn):
        def wrapper(base_sd, ckpt_sd, *args, **kwargs):
            out, st = fn(base_sd, ckpt_sd, *args, **kwargs)
            fresh = next(t for n, t in out.items() if t is not ckpt_sd[n] and t is not base_sd[n])
            made.append(weakref.ref(fresh))
            return out, st
        return wrapper

    for name in ("apply_threshold", "random_mask", "uniform_shrink"):
        monkeypatch.setattr(sparsify, name, tracked(getattr(sparsify, name)))
    alive_at_eval = []

    def pass1(base_spec, sd, tag, seed=0, label=""):
        alive_at_eval.append(sum(r() is not None for r in made))
        return [0.5, 0.25]

    fake = types.SimpleNamespace(hash=lambda spec: "h", state_dict_pass1=pass1)
    monkeypatch.setattr(sparsity_mod, "measures_for", lambda ctx, cfg: fake)
    cfg = StudyConfig(model=tiny_spec(), sparsity=(0.5, 0.9, 0.99))
    res = sparsity_mod.sparsity_task(TaskContext(root=tmp_path, deps={}, log=lambda s: None), cfg, "es-s0")
    assert len(made) == 9 and [p["target_sparsity"] for p in res["points"]] == [0.5, 0.9, 0.99]
    # the base and the full run (no modified copy yet), then each of the 9 copies alone
    assert alive_at_eval == [0, 0] + [1] * 9
    assert all(r() is None for r in made)  # none kept past its evaluation
