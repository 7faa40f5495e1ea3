"""Copy real `kvtier eval` runs into a results page: their tables between the eval markers and the
runs' plot as docs/eval.png (one panel per context). Nothing is hand-edited; rerun after `kvtier eval`:

    .venv/bin/kvtier eval --suite ruler --model qwen2.5-coder-0.5b --out results
    .venv/bin/python tools/readme_results.py --into docs/results/2026-12-01-ruler-niah.md results [more dirs...]

`--plot PATH` draws the plot there instead of docs/eval.png (a page of its own keeps the other
pages' plot as it is).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvtier.eval import report

BEGIN, END = "<!-- eval:begin -->", "<!-- eval:end -->"
LEGEND = ("`*` marks anchors; `[lo, hi]` is the 95% bootstrap interval over samples; the Δ column is the paired "
          "difference to the reference, `≈` where its interval holds zero; recalled L2/L3: blocks attended at "
          "decode that came from DRAM / SSD.")


def describe(doc: dict) -> str:
    """One sentence on what a run measured and how long it took."""
    s = doc["settings"]
    if s.get("suite") == "ruler":
        what = (f"RULER tasks {', '.join(s['tasks'])}, {s['samples']} samples each"
                + (f", at most {s['max_new_tokens']} new tokens" if s.get("max_new_tokens") else ""))
    else:
        what = (f"continuation {s['continuation']}, {s['windows']} text + "
                f"{s['windows'] if s.get('probe', True) else 0} probe windows")
    partial = doc.get("partial")
    stopped = (f"; stopped after {partial['samples_done']} of its {partial['samples']} samples at context "
               f"{partial['context']}" if partial else "")
    return (f"Run of `kvtier eval` on {doc['created']} ({doc['model']['name']}, {doc['model']['dtype']}, "
            f"{doc['model'].get('threads', '?')} threads; contexts {s['contexts']}; {what}; seed {s['seed']}; "
            f"{doc['elapsed_s']:.0f} s on this machine{stopped}).")


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    target = root / "docs" / "results" / "2026-12-01-ruler-niah.md"
    plot_path = root / "docs" / "eval.png"
    while argv[:1] in (["--into"], ["--plot"]):
        if argv[0] == "--into":
            target = Path(argv[1]).resolve()
        else:
            plot_path = Path(argv[1]).resolve()
        argv = argv[2:]
    dirs = [Path(a) for a in argv] or [Path("results")]
    docs = []
    for d in dirs:
        doc = json.loads((d / "eval.json").read_text())
        report.validate(doc)
        docs.append(doc)
    parts = [BEGIN]
    for doc in docs:
        parts += [describe(doc), "", report.markdown_table(doc), ""]
    parts[1] += " " + LEGEND
    plot = Path(os.path.relpath(plot_path, target.parent))
    parts += [f"![accuracy vs footprint]({plot})", END]
    text = target.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{target} has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    target.write_text(head + "\n".join(parts) + tail)
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    # drawn again, not copied from the run, so the plot follows the current report code; several
    # runs make one panel per context
    seen, rows = set(), []
    for r in (r for doc in docs for r in doc["results"]):
        if (r["config"], r["context"]) not in seen:  # a row rerun with the same samples: the first
            seen.add((r["config"], r["context"]))
            rows.append(r)
    report.plot(dict(docs[0], results=rows), plot_path)
    print(f"{target.name} and {os.path.relpath(plot_path, root)} updated from {', '.join(str(d / 'eval.json') for d in dirs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
