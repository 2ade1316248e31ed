"""The analysis.json document of an analysis: its header (`deltalens.schema.new_document`) and the
`models` entries, which say whether each compared model is a run directory and which method made it."""

from __future__ import annotations

from pathlib import Path

from deltalens.io.runs import RunDir
from deltalens.methods import is_run_method
from deltalens.schema import new_document


def model_entry(label: str, path, shown: str | None = None) -> dict:
    """The schema's models[] entry: kind "run" for a deltalens run directory (`RunDir.is_run`), with
    its method from the run's config when it names one (`deltalens.methods`), else "checkpoint". `shown`:
    the path written into the document when it differs from the one read (a study's runs, relative to
    the study)."""
    p = Path(str(path))
    kind, method = "checkpoint", None
    if RunDir.is_run(p):
        kind = "run"
        m = RunDir(p).method()
        method = m if is_run_method(m) else None
    return {"label": label, "path": str(path) if shown is None else shown, "kind": kind, "method": method}


def analysis_document(base_path, models: list[dict], **sections) -> dict:
    """An analysis.json document: header (schema_version, version, created, base, models) + sections."""
    return new_document(base_path, models, **sections)
