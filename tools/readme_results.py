"""Copy a real `kvtier eval` run into the README: the table between the eval markers and the
plot as docs/eval.png. Nothing is hand-edited; rerun after `kvtier eval`:

    .venv/bin/kvtier eval --suite ruler --model qwen2.5-coder-0.5b --out results
    .venv/bin/python tools/readme_results.py results
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
    if s.get("suite") == "ruler":
        what = (f"RULER tasks {', '.join(s['tasks'])}, {s['samples']} samples each"
                + (f", at most {s['max_new_tokens']} new tokens" if s.get("max_new_tokens") else ""))
    else:
        what = (f"continuation {s['continuation']}, {s['windows']} text + "
                f"{s['windows'] if s.get('probe', True) else 0} probe windows")
    block = "\n".join([
        BEGIN,
        f"Run of `kvtier eval` on {doc['created']} ({doc['model']['name']}, {doc['model']['dtype']}, "
        f"{doc['model'].get('threads', '?')} threads; contexts {s['contexts']}; {what}; seed {s['seed']}; "
        f"{doc['elapsed_s']:.0f} s on this machine). `*` marks anchors; `[lo, hi]` is the 95% bootstrap "
        "interval over samples; the Δ column is the paired difference to the reference, `≈` where its "
        "interval holds zero; recalled L2/L3: blocks attended at decode that came from DRAM / SSD.",
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
