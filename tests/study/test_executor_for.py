"""`deltalens study --ray ADDRESS --ray-files MODE`: the executor the study runs on, and how files travel."""

from __future__ import annotations

import types

import pytest

from deltalens.errors import DeltalensError
from deltalens.study import cluster
from deltalens.study import run as study_run
from deltalens.study.config import StudyConfig
from deltalens.study.executor import LocalExecutor


def _fake_ray(monkeypatch) -> list[dict]:
    made = []

    class RayExecutor:
        def __init__(self, **kw):
            made.append(kw)

    real = cluster.importlib.import_module
    monkeypatch.setattr(cluster.importlib, "import_module", lambda name: types.SimpleNamespace(
        RayExecutor=RayExecutor) if name == "deltalens.study.ray_executor" else real(name))
    return made


@pytest.mark.parametrize("files,want", [
    ("auto", {}), ("shared", {"shared_fs": True}), ("objects", {"shared_fs": False}),
    ("/mnt/transfer", {"artefacts": "/mnt/transfer"}),
])
def test_ray_files_choose_how_files_travel(monkeypatch, files, want):
    made = _fake_ray(monkeypatch)
    log = [].append
    study_run.executor_for(StudyConfig(ray="auto", ray_files=files), log=log)
    assert made == [{"address": "auto", "log": log, **want}]


def test_without_ray_the_study_runs_here_and_ray_options_are_refused():
    assert isinstance(study_run.executor_for(StudyConfig()), LocalExecutor)
    with pytest.raises(DeltalensError, match="ray"):
        StudyConfig.resolve(given={"ray_files": "shared"})
