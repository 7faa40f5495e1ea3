"""The package's shape, checked from its source text: no import circle among kvtier's modules, and
no C source hidden in a Python string (C lives in kvtier/csrc, where a compiler's warnings and a
reader's editor see it).

Every import counts, wherever it is written (module level, inside a function, under
``TYPE_CHECKING``): a circle is a circle in the design even where the interpreter happens to
tolerate it. ``python tests/test_import_graph.py`` prints the circles it finds.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvtier"


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root`` (a package's is its ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports: ``from a import b``
    is an import of ``a.b`` where that is a module, else of ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a path back to its start) per strongly connected group of modules (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_back(graph, group) for group in groups]


def _path_back(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest path within ``group`` from its first module back to itself."""
    start = min(group)
    came = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while came[path[-1]] is not None:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


# Preprocessor lines (a Python comment has a space after its "#").
C_IN_PYTHON = re.compile(r"^\s*#(include\s*[<\"]|define\s+[A-Z_][A-Z0-9_]*\b|pragma\s+(omp|GCC)\b)", re.MULTILINE)


def test_no_import_circles():
    found = circles(graph())
    assert not found, "import circles in kvtier/:\n" + "\n".join(" -> ".join(c) for c in found)


def test_graph_sees_every_kind_of_import(tmp_path):
    """The walker itself: relative, function-level and ``from package import module`` imports
    all make edges, and a circle through them is found."""
    pkg = tmp_path / "kvtier"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from ..b import g\n")
    (pkg / "b.py").write_text("from kvtier.sub import c\n")
    (pkg / "sub" / "c.py").write_text("import kvtier.sub.a\n")
    mods = modules(pkg)
    g = {name: imports(name, path, set(mods)) for name, path in mods.items()}
    assert g == {"kvtier": set(), "kvtier.sub": {"kvtier.sub.a"}, "kvtier.sub.a": {"kvtier.b"},
                 "kvtier.b": {"kvtier.sub.c"}, "kvtier.sub.c": {"kvtier.sub.a"}}
    assert circles(g) == [["kvtier.b", "kvtier.sub.c", "kvtier.sub.a", "kvtier.b"]]


def test_no_c_source_in_python_files():
    assert not C_IN_PYTHON.search("import os\n# include <these> and #define LIMITS below\n")  # a comment
    assert C_IN_PYTHON.search('SRC = r"""\n#include <stdint.h>\n"""\n')
    assert C_IN_PYTHON.search('SRC = """\n  #define HDR 24\n"""\n')
    hits = [f"{path.relative_to(PACKAGE.parent)}:{text[:m.start()].count(chr(10)) + 1}"
            for path in sorted(PACKAGE.rglob("*.py")) for text in [path.read_text()]
            for m in [C_IN_PYTHON.search(text)] if m]
    assert not hits, f"C source inside Python files (move it to kvtier/csrc/): {hits}"


if __name__ == "__main__":
    for c in circles(graph()):
        print(" -> ".join(c))
