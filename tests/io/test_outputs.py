"""The output guard's rules, path by path (the commands' use of it is tested in tests/cli/test_reliability.py)."""

from __future__ import annotations

import pytest

from deltalens.errors import DeltalensError
from deltalens.io.atomic import write_json_atomic
from deltalens.io.outputs import Output, check_outputs


@pytest.fixture
def layout(tmp_path):
    """A weight file with a config.json beside it, an HF model directory and a (chain) run directory."""
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "x.safetensors").write_bytes(b"weights")
    (tmp_path / "w" / "config.json").write_text("{}")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run = tmp_path / "run"
    for d in (run, run / "es"):
        (d / "checkpoints" / "final").mkdir(parents=True)
        (d / "checkpoints" / "final" / "config.json").write_text("{}")
        write_json_atomic({"method": "es"}, d / "config.json")
        (d / "metrics.jsonl").write_text("")
    return tmp_path


def ok(outputs, **inputs) -> None:
    check_outputs(outputs, **inputs)


def bad(outputs, match, **inputs) -> None:
    with pytest.raises(DeltalensError, match=match):
        check_outputs(outputs, **inputs)


def test_inputs_are_never_outputs(layout):
    w, model, run = layout / "w" / "x.safetensors", layout / "model", layout / "run"
    bad([Output(w, "--json")], "would overwrite the input", models=[w])
    bad([Output(layout / "w" / "config.json", "--json")], "would overwrite the input", models=[w])  # its architecture
    ok([Output(layout / "w" / "other.json", "--json")], models=[w])
    bad([Output(model / "r.json", "--json")], "lies inside the input model", models=[model])
    bad([Output(model / "sub" / "r.json", "--json")], "lies inside the input model", models=[model])
    for inside in ("config.json", "metrics.jsonl", "state.json", "checkpoints/final/model.safetensors",
                   "es/report.html", ".lock"):
        bad([Output(run / inside, "-o")], "would write into the run", models=[run])
    ok([Output(run / "report.html", "-o"), Output(run / "report.cache", "cache", directory=True)], models=[run])
    (layout / "data.jsonl").write_text("{}")
    bad([Output(layout / "data.jsonl", "--json")], "would overwrite the input", files=[layout / "data.jsonl"])
    ok([Output(layout / "r.json", "--json")], models=["some/hub-id", layout / "missing.pt"])  # nothing local


def test_directory_outputs_may_not_hold_inputs(layout):
    run, model = layout / "run", layout / "model"
    bad([Output(layout, "--out", directory=True)], "holds the input", models=[model])
    bad([Output(run, "--out", directory=True)], "holds the input", models=[run / "checkpoints" / "final"])
    bad([Output(run, "--out", directory=True)], "would write into the run", models=[run])
    ok([Output(layout / "new-run", "--out", directory=True)], models=[run, model])


def test_symlinks_are_followed(layout):
    (layout / "link.safetensors").symlink_to(layout / "w" / "x.safetensors")
    bad([Output(layout / "link.safetensors", "--json")], "would overwrite the input",
        models=[layout / "w" / "x.safetensors"])


def test_outputs_must_be_distinct_and_writable(layout):
    bad([Output(layout / "a", "--json"), Output(layout / "a", "--csv")], "name the same path")
    bad([Output(layout / "model", "--json")], "is a directory")
    bad([Output(layout / "w" / "x.safetensors", "--out", directory=True)], "exists and is not a directory")
    bad([Output(layout / "w" / "x.safetensors" / "deeper" / "a.json", "--json")], "is a file, not a directory")
    ok([Output(layout / "new" / "deeper" / "a.json", "--json")])
    assert not (layout / "new").exists()  # the guard writes nothing
