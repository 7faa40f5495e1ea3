"""The field docstrings of a dataclass, read from its source: the one parser behind
``help(KVTierConfig)`` (the class ``__doc__`` is built from them at import) and
tools/config_doc.py (docs/configuration.md). A field's docstring is the string literal right
under its annotated assignment, as in vLLM's ``config/cache.py``; Python keeps no trace of it at
run time, so it is read from the source text."""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import NamedTuple


class FieldDoc(NamedTuple):
    name: str
    type: str  # the annotation as written
    default: str  # the default as written ("" when none)
    doc: str  # as inspect.cleandoc leaves it (dedented, stripped); "" when the field has none


def field_docs(source: str, class_name: str) -> list[FieldDoc]:
    """Every annotated field of class ``class_name`` in module source ``source``, in source order."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    out = []
    for i, node in enumerate(cls.body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        nxt = cls.body[i + 1] if i + 1 < len(cls.body) else None
        doc = (nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
               and isinstance(nxt.value.value, str) else "")
        default = ast.unparse(node.value) if node.value is not None else ""
        out.append(FieldDoc(node.target.id, ast.unparse(node.annotation), default,
                            inspect.cleandoc(doc)))
    return out


def class_doc(summary: str, fields: list[FieldDoc]) -> str:
    """``summary`` followed by one entry per field (name, type, default, docstring), the form
    ``help()`` and pydoc show."""
    entries = []
    for f in fields:
        head = f"{f.name}: {f.type}" + (f" = {f.default}" if f.default else "")
        entries.append(head + "\n" + textwrap.indent(f.doc, "    "))
    return summary.strip() + "\n\nFields:\n\n" + "\n\n".join(entries) + "\n"
