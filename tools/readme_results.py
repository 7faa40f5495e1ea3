"""Copy a real `kvtier eval` run into the README: the table between the eval markers and the
plot as docs/eval.png. Nothing is hand-edited; rerun after `kvtier eval`:

    .venv/bin/kvtier eval --quick --out results && .venv/bin/python tools/readme_results.py results
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from kvtier.eval import report

BEGIN, END = "<!-- eval:begin -->", "<!-- eval:end -->"


def main(argv: list[str]) -> int:
    results = Path(argv[0] if argv else "results")
    root = Path(__file__).resolve().parent.parent
    doc = json.loads((results / "eval.json").read_text())
    report.validate(doc)
    s = doc["settings"]
    block = "\n".join([
        BEGIN,
        f"Run of `kvtier eval{' --quick' if s.get('quick') else ''}` on {doc['created']} "
        f"({doc['model']['name']}, {doc['model']['dtype']}; contexts {s['contexts']}, "
        f"continuation {s['continuation']}, {s['windows']} text + {s['windows'] if s.get('probe', True) else 0} "
        f"probe windows; {doc['elapsed_s']:.0f} s on this machine). `*` marks transformers anchors; "
        "probe is accuracy/reference accuracy.",
        "",
        report.markdown_table(doc),
        "",
        "![accuracy vs footprint](docs/eval.png)",
        END,
    ])
    readme = root / "README.md"
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + block + tail)
    (root / "docs").mkdir(exist_ok=True)
    shutil.copyfile(results / "eval.png", root / "docs" / "eval.png")
    print(f"README.md and docs/eval.png updated from {results / 'eval.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
