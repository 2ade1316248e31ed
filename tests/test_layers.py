"""The package's import graph: no cycles (imports inside functions count too), layers import only
downward, reports never reach torch, and every declared dependency is imported somewhere."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject's package-dir)
FOLDERS = {"deltalens": "deltalens", "cli": "deltalens.cli", "reports": "deltalens.reports"}

# lowest first; a module may import modules of its own layer or below (never above)
LAYERS = [
    ("deltalens", "deltalens.errors", "deltalens.config", "deltalens.schema", "deltalens.presets"),
    ("deltalens.io", "deltalens.tiny"),  # deltalens.tiny names io.spec's TINY_DIR; its build trains (layer 3)
    ("deltalens.tasks",),
    ("deltalens.generation", "deltalens.tiny.build"),
    ("deltalens.evaluation",),
    ("deltalens.training",),
    ("deltalens.analysis",),
    ("deltalens.study", "deltalens.demo"),
    ("deltalens.cli",),
]


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports, anywhere in the file (top level or inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import deltalens.io.models as m` -> that module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports(m, p, known) for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> int:
    best, level = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    assert level is not None, f"{module} has no layer in tests/test_layers.py"
    return level


def test_scan_finds_the_imports_it_should():
    g = graph()
    assert "deltalens.training.es.engine" in g["deltalens.training.es.backends.local"]
    assert "deltalens.io.spec" in g["deltalens.io.models"]
    # an import inside a function counts (the method registry imports the trainers lazily)
    assert "deltalens.training.es.train" in g["deltalens.training.methods"]
    # a cycle is found when there is one
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_layers_import_only_downward():
    bad = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
           for m, targets in graph().items() for t in sorted(targets)
           if not m.startswith("deltalens.reports") and layer(t) > layer(m)]
    assert bad == []


def test_reports_depend_on_the_schema_only():
    g = graph()
    for m, targets in g.items():
        if m.startswith("deltalens.reports"):
            outside = {t for t in targets if not t.startswith("deltalens.reports")}
            assert outside <= {"deltalens", "deltalens.errors", "deltalens.schema"}, (m, outside)


def test_every_declared_dependency_is_imported():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ \[]", d, maxsplit=1)[0].lower() for d in deps}
    import_name = {"pyyaml": "yaml"}
    text = "\n".join(p.read_text(encoding="utf-8") for p in modules().values())
    unused = [n for n in sorted(names)
              if not re.search(rf"^\s*(import|from) {re.escape(import_name.get(n, n))}\b", text, re.MULTILINE)]
    assert unused == []
