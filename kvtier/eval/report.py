"""Turns sweep rows into the three outputs of `kvtier eval`: a table, a JSON file and a PNG plot.

JSON schema (version 2)::

    {"schema": "kvtier-eval/2", "kvtier_version": str, "created": ISO-8601 str,
     "model": {"name": str, "layers": int, "kv_heads": int, "head_dim": int, "dtype": str, ...},
     "settings": {"suite": "text"|"ruler", "contexts": [int], "seed": int, ...},
     "reference": str, "elapsed_s": float,
     "results": [{"config": str, "kind": str, "anchor": bool, "params": {...}, "context": int,
                  "accuracy": {text suite: "ppl", "ppl_ref", "ppl_rel_change", "kl_mean",
                               "top1_agreement", "probe_acc", "probe_acc_ref", "probe_rel";
                               ruler suite: "ruler", "ruler_ref", "ruler_rel", "ruler_tasks",
                               "samples": [{"task", "index", "seed", "score", "partial", "prediction",
                                            "fidelity"?}] (a sample is named by task, index and the
                                            run's --seed: merged runs stay apart),
                               with --fidelity "fidelity_kl", "fidelity_top1", "fidelity_steps";
                               both: "ci": {metric: {"mean", "lo", "hi", "n"}} (95% bootstrap),
                               "diff": {metric: {"mean", "lo", "hi", "n", "within_ci"}}
                               (paired against the reference)},
                  "footprint": {"l1_bytes_per_token", "l2_bytes_per_token", "l3_bytes_per_token",
                                "total_bytes_per_token", "peak_l1_bytes", "compression"?: {...}},
                  "cost": {"decode_tok_s", "tpot_p50_ms", "tpot_p99_ms", "prefill_s", "ttft_s",
                           "shared_prefill", "swap_bytes_per_token"?, "prefetch_precision"?,
                           "prefetch_coverage"?, "recalled_from"?: {"l1", "l2", "l3"}},
                  "stats": {... kvtier stats() of the last window, {} for anchors}}]}
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from kvtier.eval.metrics import pareto_front

SCHEMA = "kvtier-eval/2"
RESULT_KEYS = ("config", "kind", "anchor", "params", "context", "accuracy", "footprint", "cost", "stats")


def validate(doc: dict) -> None:
    """Raise ValueError when ``doc`` does not follow the schema above."""
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"schema must be {SCHEMA!r}, got {doc.get('schema')!r}")
    for key in ("kvtier_version", "created", "model", "settings", "reference", "results"):
        if key not in doc:
            raise ValueError(f"missing top-level key {key!r}")
    if not isinstance(doc["results"], list) or not doc["results"]:
        raise ValueError("results must be a non-empty list")
    for i, r in enumerate(doc["results"]):
        missing = [k for k in RESULT_KEYS if k not in r]
        if missing:
            raise ValueError(f"results[{i}] misses {missing}")
        for k in ("l1_bytes_per_token", "total_bytes_per_token"):
            if not isinstance(r["footprint"].get(k), (int, float)):
                raise ValueError(f"results[{i}].footprint.{k} must be a number")
        if not isinstance(r["cost"].get("decode_tok_s"), (int, float)):
            raise ValueError(f"results[{i}].cost.decode_tok_s must be a number")


def _clean(x):
    """JSON has no NaN/Inf: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(doc: dict, path: Path) -> None:
    validate(doc)
    path.write_text(json.dumps(_clean(doc), indent=2, sort_keys=False))


def _fmt(x, spec: str, scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x * scale, spec)


def _ci(a: dict, key: str, scale: float, spec: str) -> str:
    ci = a.get("ci", {}).get(key)
    if not ci or ci.get("lo") is None:
        return _fmt(a.get(key), spec, scale)
    return f"{_fmt(a.get(key), spec, scale)} [{_fmt(ci['lo'], spec, scale)}, {_fmt(ci['hi'], spec, scale)}]"


def _diff(a: dict, key: str, scale: float, spec: str) -> str:
    d = a.get("diff", {}).get(key)
    if not d or d.get("lo") is None:
        return "-"
    mark = " ≈" if d.get("within_ci") else ""
    return f"{_fmt(d['mean'], '+' + spec, scale)} [{_fmt(d['lo'], '+' + spec, scale)}, {_fmt(d['hi'], '+' + spec, scale)}]{mark}"


def table_rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    """Rows of the table. Accuracy figures carry their 95% interval ``[lo, hi]``; a paired
    difference whose interval holds zero is marked ``≈`` (not distinguishable from the reference)."""
    ruler = doc.get("settings", {}).get("suite") == "ruler"
    if ruler:
        head = ["context", "config", "RULER % [95% CI]", "Δ vs ref (paired)", "× ref [95% CI]", "chars %",
                "B/tok L1", "B/tok total",
                "tok/s", "TTFT s", "recalled L2/L3"]
        fidelity = any(r["accuracy"].get("fidelity_kl") is not None for r in doc["results"])
        if fidelity:
            head[6:6] = ["KL to ref [95% CI]", "top-1 to ref %"]
    else:
        head = ["context", "config", "Δppl % [95% CI]", "KL", "top-1", "probe", "probe Δ (paired)",
                "B/tok total", "B/tok L1", "tok/s", "TTFT s"]
    rows = []
    for r in doc["results"]:
        a, f, c = r["accuracy"], r["footprint"], r["cost"]
        name = ("* " if r["anchor"] else "  ") + r["config"]
        if ruler:
            rec = c.get("recalled_from")
            rows.append([str(r["context"]), name, _ci(a, "ruler", 100, ".1f"), _diff(a, "ruler", 100, ".1f"),
                         _ci(a, "ruler_rel", 1, ".2f"), _fmt(a.get("partial"), ".1f", 100),
                         _fmt(f.get("l1_bytes_per_token"), ",.0f"), _fmt(f.get("total_bytes_per_token"), ",.0f"),
                         _fmt(c.get("decode_tok_s"), ".2f"), _fmt(c.get("ttft_s"), ".1f"),
                         f"{rec['l2']}/{rec['l3']}" if rec else "-"])
            if fidelity:
                rows[-1][6:6] = [_ci(a, "fidelity_kl", 1, ".4f"), _ci(a, "fidelity_top1", 100, ".1f")]
        else:
            rows.append([
                str(r["context"]), name, _ci(a, "ppl_rel_change", 100, "+.2f"), _fmt(a.get("kl_mean"), ".4f"),
                _fmt(a.get("top1_agreement"), ".3f"),
                f"{_fmt(a.get('probe_acc'), '.2f')}/{_fmt(a.get('probe_acc_ref'), '.2f')}",
                _diff(a, "probe_acc", 1, ".2f"),
                _fmt(f.get("total_bytes_per_token"), ",.0f"), _fmt(f.get("l1_bytes_per_token"), ",.0f"),
                _fmt(c.get("decode_tok_s"), ".1f"), _fmt(c.get("ttft_s"), ".2f"),
            ])
    return head, rows


def print_table(doc: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    head, rows = table_rows(doc)
    t = Table(title=f"kvtier eval — {doc['model']['name']} (reference: {doc['reference']}; * = anchor)")
    for h in head:
        t.add_column(h, justify="left" if h == "config" else "right")
    for row in rows:
        t.add_row(*row)
    (console or Console()).print(t)


def markdown_table(doc: dict) -> str:
    """The table as markdown; for a RULER run of several tasks, a second table of the score per
    task (mean over that task's samples)."""
    head, rows = table_rows(doc)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    tasks = doc.get("settings", {}).get("tasks") or []
    if doc.get("settings", {}).get("suite") == "ruler" and len(tasks) > 1:
        lines += ["", "RULER % per task:", "", "| context | config | " + " | ".join(tasks) + " |",
                  "|" + "---|" * (len(tasks) + 2)]
        for r in doc["results"]:
            per = r["accuracy"].get("ruler_tasks", {})
            name = ("* " if r["anchor"] else "  ") + r["config"]
            lines.append(f"| {r['context']} | {name} | "
                         + " | ".join(_fmt(per.get(t), ".0f", 100) for t in tasks) + " |")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    """Accuracy against bytes per token (total and L1), one point per configuration, at the
    largest context; anchors as squares, importance-precision rows as stars; Pareto frontier drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if doc.get("settings", {}).get("suite") == "ruler":
        return _plot_ruler(doc, path, plt)
    ctx = max(r["context"] for r in doc["results"])
    rows = [r for r in doc["results"] if r["context"] == ctx]
    style = _styles(rows)
    panels = [
        ("total_bytes_per_token", "ppl_rel_change", "total KV bytes per token", "relative perplexity change (%)", 100),
        ("l1_bytes_per_token", "probe_acc", "L1 (device) KV bytes per token", "recall probe top-1 accuracy", 1),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=80)
    drawn, frontier = [], False
    for ax, (xk, yk, xl, yl, scale) in zip(axes, panels):
        pts = []
        for r in rows:
            x, y = r["footprint"].get(xk), r["accuracy"].get(yk)
            if x is None or y is None or not math.isfinite(x) or not math.isfinite(y):
                continue
            pts.append((x, y * scale))
            color, marker = style[r["config"]]
            ax.scatter([x], [y * scale], marker=marker, s=36, color=color, edgecolors="black", linewidths=0.4)
            drawn.append(r["config"])
        # lower error is better for ppl; higher accuracy is better for the probe
        err = (lambda y: abs(y)) if yk == "ppl_rel_change" else (lambda y: -y)
        front = pareto_front([(x, err(y)) for x, y in pts])
        if len(front) > 1:
            ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "--", color="tab:orange", zorder=0)
            frontier = True
        _log_x(ax)
        if yk == "ppl_rel_change":
            ax.set_yscale("symlog", linthresh=1.0)  # percent: small changes and blow-ups on one axis
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{doc['model']['name']}, context {ctx}: accuracy vs footprint (squares: transformers anchors; "
                 "stars: precision by importance)",
                 fontsize=9)
    _save_with_legend(fig, style, drawn, path, plt, frontier)


def _plot_ruler(doc: dict, path: Path, plt) -> None:
    """RULER accuracy against L1 bytes per token, one panel per context, 95% intervals as error
    bars; hollow markers: the paired difference to the reference is inside its interval."""
    contexts = sorted({r["context"] for r in doc["results"]})
    style = _styles(doc["results"])
    fig, axes = plt.subplots(1, len(contexts), figsize=(max(8.0, 5.5 * len(contexts)), 4.6), dpi=80,
                             squeeze=False)
    drawn = []
    for ax, ctx in zip(axes[0], contexts):
        for r in (r for r in doc["results"] if r["context"] == ctx):
            a = r["accuracy"]
            x, y, ci = r["footprint"].get("l1_bytes_per_token"), a.get("ruler"), a.get("ci", {}).get("ruler")
            if x is None or y is None or not ci:
                continue
            same = a.get("diff", {}).get("ruler", {}).get("within_ci")
            color, marker = style[r["config"]]
            ax.errorbar([x], [100 * y], yerr=[[100 * (y - ci["lo"])], [100 * (ci["hi"] - y)]],
                        fmt=marker, color=color, capsize=3, markersize=7, alpha=0.85,
                        mfc="white" if same and r["kind"] != "dynamic" else color)
            drawn.append(r["config"])
        _log_x(ax)
        ax.set_xlabel("L1 (device) KV bytes per token")
        ax.set_ylabel("RULER score (%), 95% CI")
        ax.set_title(f"context {ctx:,}", fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{doc['model']['name']}: RULER {', '.join(doc['settings'].get('tasks', []))}\n"
                 "squares: anchors; hollow: paired difference to the reference inside its 95% CI", fontsize=8)
    _save_with_legend(fig, style, drawn, path, plt)


def _styles(results: list[dict]) -> dict[str, tuple[tuple, str]]:
    """A colour and marker per configuration, the same in every panel (squares: anchors; stars:
    precision that follows importance; kvtier's other rows cycle through other shapes, so no two
    configurations look alike). Points are named by a
    legend keyed by these, not by text beside them, which overlaps wherever configurations land
    near each other (kvtier's sparse rows do)."""
    import matplotlib

    names = list(dict.fromkeys(r["config"] for r in results))
    anchor = {r["config"]: r["anchor"] for r in results}
    colors = matplotlib.colormaps["tab10"].colors
    style, k = {}, 0
    for i, n in enumerate(names):
        color, marker = colors[i % len(colors)], "s"
        if "importance" in n:
            marker = "*"
        elif not anchor[n]:  # the next shape whose pairing with this colour is not taken yet
            turn = _SHAPES[k % len(_SHAPES):] + _SHAPES[:k % len(_SHAPES)]
            marker = next(m for m in turn if (color, m) not in style.values())
            k += 1
        style[n] = (color, marker)
    return style


_SHAPES = ("o", "^", "D", "v", "P", "X", "<", ">", "h", "p")


def _log_x(ax) -> None:
    """Log x axis (after the points are drawn) with plain byte counts. Minor ticks are labelled
    only on a range under a decade, where no major tick may fall; matplotlib's own labels there
    ("1.05x10^3") run into each other."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:,.0f}")
    lo, hi = ax.get_xlim()
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain if hi < 10 * lo else NullFormatter())
    ax.tick_params(axis="x", which="minor", labelsize=6)


def _save_with_legend(fig, style: dict, drawn: list[str], path: Path, plt, frontier: bool = False) -> None:
    """Save ``fig`` with one legend below its panels: the configurations in ``drawn``, each as a
    filled marker of its ``style`` (hollow or not is said in the title), and the Pareto frontier."""
    from matplotlib.lines import Line2D

    names = list(dict.fromkeys(drawn))
    handles = [Line2D([], [], color=style[n][0], marker=style[n][1], linestyle="none", markersize=7,
                      markeredgecolor="black", markeredgewidth=0.4) for n in names]
    if frontier:
        names.append("Pareto frontier")
        handles.append(Line2D([], [], color="tab:orange", linestyle="--"))
    fig.tight_layout()
    if handles:
        fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(3, len(handles)),
                   fontsize=8, frameon=False)
    fig.savefig(path, bbox_inches="tight")  # "tight" grows the canvas to take the legend in
    plt.close(fig)
