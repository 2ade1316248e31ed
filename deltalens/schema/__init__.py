"""The analysis.json contract: its JSON Schema (`analysis.schema.json` beside this file) and version.

Data flows one way: checkpoints -> analysis -> analysis.json -> `deltalens.reports` -> one HTML file.
Every producer builds its document with `new_document` and every consumer checks the version with
`check_version`; `SCHEMA_VERSION` is read from the schema file (`properties.schema_version.const`), so
the version is written in one place. Prose description: docs/analysis-schema.md.

Torch-free and dependency-light: `deltalens.reports` imports this module and `deltalens.errors` only.
"""

from __future__ import annotations

import datetime
import gzip
import json
import zlib
from functools import lru_cache
from importlib import resources
from pathlib import Path

from deltalens import __version__
from deltalens.errors import DeltalensError

SCHEMA_FILE = "analysis.schema.json"


@lru_cache(maxsize=1)
def schema() -> dict:
    """The JSON Schema (draft 2020-12) of analysis.json."""
    return json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


SCHEMA_VERSION: int = schema()["properties"]["schema_version"]["const"]

# A published study's analysis.json is committed gzipped (docs/*-study-*/analysis.json.gz); readers take both.
MAX_UNPACKED = 1 << 28  # bytes a .gz analysis may unpack to (256 MiB; the largest published one: 7.9 MB)


def read_text(path) -> str:
    """The text of an analysis.json, or of an analysis.json.gz (gzip, by its suffix), as UTF-8. OSError and
    UnicodeDecodeError propagate as from `Path.read_text`; a bad gzip stream or one that unpacks to more than
    MAX_UNPACKED bytes raises DeltalensError."""
    path = Path(path)
    if path.suffix != ".gz":
        return path.read_text(encoding="utf-8")
    try:
        with gzip.open(path, "rb") as f:
            data = f.read(MAX_UNPACKED + 1)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DeltalensError(f"{path}: not a readable gzip file ({e})") from None
    if len(data) > MAX_UNPACKED:
        raise DeltalensError(f"{path}: unpacks to more than {MAX_UNPACKED:,} bytes; not an analysis")
    return data.decode("utf-8")


def new_document(base_path, models: list[dict], **sections) -> dict:
    """An analysis.json document: the header (schema_version, deltalens_version, created, base, models)
    followed by `sections` (diff, ratios, evals, sparsify, training, diversity, held_out, ...). With
    `base_path` None (an evaluation of models without a base) the document has no `base`."""
    doc = {
        "schema_version": SCHEMA_VERSION,
        "deltalens_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "base": {"label": "base", "path": str(base_path)},
        "models": models,
        **sections,
    }
    if base_path is None:
        del doc["base"]
    return doc


def check_version(doc: dict, renderer_version: str = __version__) -> int:
    """The document's schema_version, or a one-line error if this deltalens cannot read it."""
    if "schema_version" not in doc:
        raise DeltalensError("analysis.json has no schema_version: it was not written by deltalens "
                             f"(this version reads schema_version {SCHEMA_VERSION})")
    v = doc["schema_version"]
    if isinstance(v, bool) or not isinstance(v, int):
        raise DeltalensError(f"analysis.json schema_version must be an integer, got {v!r}")
    if v > SCHEMA_VERSION:
        raise DeltalensError(f"analysis.json has schema_version {v} but this deltalens ({renderer_version}) "
                             f"reads up to {SCHEMA_VERSION}: upgrade deltalens to render it")
    if v < 1:
        raise DeltalensError(f"analysis.json has unsupported schema_version {v} (expected {SCHEMA_VERSION})")
    return v


def validate(doc: dict) -> None:
    """Check `doc` against the JSON Schema; the first violation becomes a one-line DeltalensError that
    names where it is (needs the `jsonschema` package)."""
    try:
        import jsonschema
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise DeltalensError("validating analysis.json needs jsonschema: pip install jsonschema") from e
    validator = jsonschema.Draft202012Validator(schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise DeltalensError(f"analysis.json does not match the schema at {where}: {error.message[:200]}")
