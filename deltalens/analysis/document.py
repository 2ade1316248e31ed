"""The analysis.json document of an analysis: its header (`deltalens.schema.new_document`) and the
`models` entries, which say whether each compared model is a run directory and which method made it."""

from __future__ import annotations

from pathlib import Path

from deltalens.io.runs import RunDir
from deltalens.io.spec import ModelRef
from deltalens.methods import is_run_method
from deltalens.schema import new_document


def model_entry(label: str, path: str | Path | ModelRef, shown: str | None = None) -> dict:
    """The schema's models[] entry: kind "run" for a deltalens run directory, with its method from the
    run's config when it names one (`deltalens.methods`), else "checkpoint". `path`: a resolved
    `ModelRef` (its `run` says whether it is a run directory; its spec is the path written), or a path
    (checked with `RunDir.is_run`, the one run-directory check). `shown`: the path written into the
    document when it differs from the one read (a study's runs, relative to the study)."""
    if isinstance(path, ModelRef):
        run, path = path.run, path.spec
    else:
        run = Path(str(path)) if RunDir.is_run(Path(str(path))) else None
    kind, method = "checkpoint", None
    if run is not None:
        kind = "run"
        m = RunDir(run).method()
        method = m if is_run_method(m) else None
    return {"label": label, "path": str(path) if shown is None else shown, "kind": kind, "method": method}


def analysis_document(base_path, models: list[dict], **sections) -> dict:
    """An analysis.json document: header (schema_version, version, created, base, models) + sections."""
    return new_document(base_path, models, **sections)
