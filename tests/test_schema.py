"""The analysis.json contract: one JSON Schema file, one schema_version, producers validated against it
(each producer's test calls `validate`: diff, eval, sparsify, diversity, report)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from deltalens.errors import DeltalensError
from deltalens.schema import SCHEMA_VERSION, check_version, new_document, schema, validate

FIXTURE = Path(__file__).parent / "fixtures" / "analysis_full.json"


def test_version_lives_in_the_schema_file():
    assert SCHEMA_VERSION == schema()["properties"]["schema_version"]["const"] == 1
    doc = new_document("tiny", [])
    assert doc["schema_version"] == SCHEMA_VERSION and doc["base"] == {"label": "base", "path": "tiny"}
    assert "base" not in new_document(None, [])
    validate(doc)


def test_full_fixture_is_valid():
    validate(json.loads(FIXTURE.read_text()))


@pytest.mark.parametrize(("path", "value", "where"), [
    (("diff", "es", "whole", "n"), -1, "diff/es/whole/n"),
    (("evals", "base", "pass_at_k", "1"), 1.5, "evals/base/pass_at_k/1"),
    (("evals", "base", "pass_at_k"), {"one": 0.5}, "evals/base/pass_at_k"),
    (("schema_version",), 2, "schema_version"),
    (("models",), "es", "models"),
])
def test_violations_name_where_they_are(path, value, where):
    doc = copy.deepcopy(json.loads(FIXTURE.read_text()))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(DeltalensError) as e:
        validate(doc)
    assert f"at {where}" in str(e.value) and "\n" not in str(e.value)


def test_check_version():
    assert check_version({"schema_version": 1}) == 1
    for bad, msg in [({}, "no schema_version"), ({"schema_version": "1"}, "must be an integer"),
                     ({"schema_version": 2}, "upgrade deltalens"), ({"schema_version": 0}, "unsupported")]:
        with pytest.raises(DeltalensError, match=msg):
            check_version(bad)
