"""`deltalens study verify STUDY`: re-derive a study's every check from its analysis.json alone.

A reviewer's question about a published study is "do these verdicts follow from these data?". A study's
analysis.json carries every input its checks use (issue #34): the per-problem results of every evaluation
(each base sampling seed, each run, each temperature) under `study.data.evaluations`, the sparsity sweep and
the per-prompt entropy under `study.data`, the weight diff (`diff`), the population pass (`diversity`), and
claim 7's paired rewards inside that check (`pairs`). This module rebuilds the study's settings
(`study.config`) and run plan (`study.runs`) from the document, hands those inputs to the function the
study itself derives its checks with (`deltalens.study.run.study_checks`, Holm included), and compares the
result with the checks the document states, field by field:

    identical    every field the document states of every check agrees (floats to a relative 1e-9: the
                 same arithmetic on the same inputs; an undefined number is null in JSON), and so does
                 every claim's verdict; fields a later deltalens adds to a check are listed, not counted
    differs      a field differs (named, with both values), a stated check is not re-derived, or a
                 re-derived check is not stated

No model, checkpoint or dataset is read: a published analysis.json.gz in docs/
is enough. A document written by an older deltalens may differ where the checks changed since (a new
field, a renamed check); the comparison says which.
"""

from __future__ import annotations

import json
import math

from deltalens.errors import DeltalensError
from deltalens.study.config import StudyConfig
from deltalens.study.plan import t_key
from deltalens.study.run import study_checks, study_claims
from deltalens.study.runs import TWO_POINT, by_group
from deltalens.study.scale import read_study

RTOL = 1e-9  # floats re-derived from the same inputs by the same code agree to rounding
# what the document's `study.config` holds in another form than --temperature/--temperatures (`analyse`): the
# verdict temperature and every evaluated temperature (budget and preset are stored resolved, read as given)
_DERIVED = ("temperature", "temperatures")


def config_of(study: dict, where: str = "the document") -> StudyConfig:
    """The study's settings from `study.config`: the evaluated temperatures as --temperatures, the preset and
    budget as resolved (the same runs), every other field as given. `where` names the file in a refusal."""
    c = study.get("config")
    if not isinstance(c, dict):
        raise DeltalensError(f"{where}: the study section has no config")
    given = {k: v for k, v in c.items() if k not in _DERIVED}
    given["temperatures"] = c.get("temperatures") or [c.get("temperature")]
    try:
        return StudyConfig.from_dict(given, source="study.config")
    except DeltalensError as e:
        raise DeltalensError(f"{where}: study.config: {e}") from None


def _need(d: dict, key: str, where: str, file: str):
    """d[key], or a one-line refusal naming the file and where in it the input is missing."""
    if not isinstance(d, dict) or key not in d:
        raise DeltalensError(f"{file} has no {where}{key}: it cannot be re-derived (written by a deltalens "
                             "that did not publish it)")
    return d[key]


def inputs_of(doc: dict, cfg: StudyConfig, groups: dict, file: str = "the document") -> tuple[dict, str | None]:
    """`study_checks`' inputs from the document (module docstring), and the task spec of its sparsify section;
    `file` names the document in a refusal."""
    study = doc["study"]
    data = _need(study, "data", "study.", file)
    stored = _need(data, "evaluations", "study.data.", file)
    evaluations = {}
    for t in cfg.eval_temperatures:
        key = t_key(t)
        rows = _need(stored, key, "study.data.evaluations.", file)
        evaluations[key] = {"base": [{"per_problem": r} for r in _need(rows, "base", f"evaluations[{key}].", file)],
                            **{r["label"]: {"per_problem": _need(rows, r["label"], f"evaluations[{key}].", file)}
                               for rs in groups.values() for r in rs}}
    pairs = {}
    if TWO_POINT in groups:
        for cl in study["claims"]:
            for ch in cl.get("checks", []):
                if isinstance(ch, dict) and isinstance(ch.get("pairs"), dict):
                    pairs.update(ch["pairs"])
    sparsify = doc.get("sparsify") or {}
    task_spec = next((s.get("task") for s in sparsify.values() if isinstance(s, dict)), None)
    needs_sparsity = {"es", "grpo"} & set(groups)
    return {"evaluations": evaluations, "pairs": pairs,
            "diff": doc.get("diff") if {"es", "grpo"} <= set(groups) else None,
            "sparsity": _need(data, "sparsity", "study.data.", file) if needs_sparsity else {},
            "entropy": _need(data, "entropy", "study.data.", file),
            "diversity": doc.get("diversity") or {}}, task_spec


def _nan(x) -> bool:
    """JSON has no NaN: the study writes an undefined number (a one-seed interval) as null."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def _same(a, b) -> bool:
    if _nan(a) or _nan(b):
        return _nan(a) and _nan(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or abs(a - b) <= RTOL * max(abs(a), abs(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _plain(v):
    """A check's value as JSON has it (tuples as lists, numpy scalars as floats)."""
    return json.loads(json.dumps(v, default=float))


def compare(stated: list[dict], derived: list[dict]) -> list[dict]:
    """Per check (claim, name): "identical", or "differs" with the fields that differ, or "not re-derived"
    (stated only) / "not stated" (derived only)."""
    def keyed(checks):  # (claim, name, occurrence): a name given twice is two checks, compared in order
        seen: dict = {}
        out = {}
        for c in checks:
            k = (c.get("claim"), c.get("check"))
            seen[k] = seen.get(k, -1) + 1
            out[(*k, seen[k])] = c
        return out

    have, got = keyed(stated), {k: _plain(c) for k, c in keyed(derived).items()}
    out = []
    for k in [*have, *(k for k in got if k not in have)]:
        row = {"claim": k[0], "check": k[1]}
        if k not in got:
            out.append({**row, "status": "not re-derived"})
        elif k not in have:
            out.append({**row, "status": "not stated"})
        else:
            a, b = have[k], got[k]
            fields = [f for f in sorted(a) if not (f in b and _same(a[f], b[f]))]
            added = sorted(set(b) - set(a))  # fields a later deltalens records: not a disagreement
            out.append({**row, "status": "differs" if fields else "identical",
                        "fields": {f: {"stated": a.get(f), "derived": b.get(f)} for f in fields},
                        **({"added": added} if added else {})})
    return out


def verify(path) -> dict:
    """Re-derive the study at `path` (module docstring): {"file", "checks": n, "identical": n, "differing": [rows
    of `compare` that are not identical], "claims": [{id, stated, derived}], "ok": bool, "rows": every row}."""
    f, doc = read_study(path)
    study = doc["study"]
    cfg = config_of(study, str(f))
    runs = _need(study, "runs", "study.", str(f))
    groups = by_group(runs)
    inputs, task_spec = inputs_of(doc, cfg, groups, str(f))
    try:
        derived, _, _ = study_checks(cfg, groups, inputs, task_spec)
    except (KeyError, IndexError, TypeError) as e:  # a document missing an input the checks need
        raise DeltalensError(f"{f}: an input of the checks is missing or malformed ({type(e).__name__}: {e}); "
                             "it cannot be re-derived") from None
    stated = [c for cl in study["claims"] for c in cl.get("checks", []) if isinstance(c, dict)]
    rows = compare(stated, derived)
    verdicts = {cl["id"]: cl["verdict"] for cl in study_claims(cfg, derived)}
    claims = [{"id": cl.get("id"), "stated": cl.get("verdict"), "derived": verdicts.get(cl.get("id"))}
              for cl in study["claims"]]
    differing = [r for r in rows if r["status"] != "identical"]
    ok = not differing and all(c["stated"] == c["derived"] for c in claims)
    return {"file": str(f), "checks": len(rows), "identical": len(rows) - len(differing), "differing": differing,
            "claims": claims, "ok": ok, "rows": rows}
