"""analysis.json's models[] entries (`deltalens.analysis.document.model_entry`): a resolved reference says
whether it is a run (`ModelRef.run`) without a second run-directory check."""

from __future__ import annotations

import json

from deltalens.analysis.document import model_entry
from deltalens.io.runs import RunDir
from deltalens.io.spec import ModelRef


def _run_dir(tmp_path, method="es"):
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"method": method}))
    (d / "metrics.jsonl").write_text("")
    return d


def test_a_reference_entry_takes_its_run_from_the_reference(tmp_path, monkeypatch):
    d = _run_dir(tmp_path)
    ref = ModelRef(str(d), "hf_dir", d / "checkpoints" / "final", run=d)
    plain = model_entry("es", str(d))
    monkeypatch.setattr(RunDir, "is_run", staticmethod(lambda p: (_ for _ in ()).throw(AssertionError(p))))
    assert model_entry("es", ref) == plain == {"label": "es", "path": str(d), "kind": "run", "method": "es"}
    other = ModelRef("tiny", "hf_dir", tmp_path)
    assert model_entry("t", other) == {"label": "t", "path": "tiny", "kind": "checkpoint", "method": None}
    assert model_entry("es", ref, shown="runs/es")["path"] == "runs/es"
