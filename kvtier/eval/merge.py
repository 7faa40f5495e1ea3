"""Several RULER runs of `kvtier eval` as one: the rows' samples pooled, the accuracy recomputed.

A long evaluation is split over processes (a half of the tasks each, one core each) or sessions
(another seed, more samples), and what it measured is the union: one table over all samples, with
intervals over all of them and each row paired with the reference on the same samples. Samples are
named by (task, index, seed) (eval.json's sample records; a file written before records carried
their seed takes its run's ``--seed``). Accuracy is recomputed from the records with the harness's
own function (:func:`kvtier.eval.sweep.ruler_accuracy`), so a merged row reads as a row of one run
would. Footprint and cost are the runs' figures averaged over their samples (a decode rate of a
merged row is such a mean, not a recount of its steps).

A run stopped early (eval.json marked ``"partial"``) counts with the samples it finished. Refused,
naming the run: a text-suite run (its windows keep no per-sample records), runs of
another model or dtype, another reference row, a sample two runs scored differently (the same
sample must give the same greedy answer), and a row whose samples the reference lacks.
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path

from kvtier.eval import report
from kvtier.eval.sweep import ruler_accuracy

_FP_MEAN = ("l1_bytes_per_token", "l2_bytes_per_token", "l3_bytes_per_token", "total_bytes_per_token")


def merge(docs: list[dict], names: list[str]) -> dict:
    """One eval.json document of the RULER runs ``docs`` (``names``: where each came from, for
    errors and the merged settings). Raises ValueError naming the run that cannot be merged."""
    if len(docs) < 2:
        raise ValueError(f"--merge needs at least two runs; got {len(docs)}")
    first = docs[0]
    for doc, name in zip(docs, names):
        report.validate(doc)
        if doc["settings"].get("suite") != "ruler":
            raise ValueError(f"{name}: only ruler-suite runs can be merged (a text run keeps no per-sample "
                             f"records); this one is suite {doc['settings'].get('suite')!r}")
        for key in ("name", "dtype"):
            if doc["model"].get(key) != first["model"].get(key):
                raise ValueError(f"{name}: model {key} {doc['model'].get(key)!r} differs from {names[0]}'s "
                                 f"{first['model'].get(key)!r}")
        if doc["reference"] != first["reference"]:
            raise ValueError(f"{name}: reference row {doc['reference']!r} differs from {names[0]}'s "
                             f"{first['reference']!r}")
    # (config, context) -> sample key -> record, plus each row's result dicts and sample counts
    records: dict[tuple, dict] = {}
    source: dict[tuple, dict] = {}
    parts: dict[tuple, list[tuple[dict, int]]] = {}
    for doc, name in zip(docs, names):
        for r in doc["results"]:
            row = (r["config"], r["context"])
            samples = r["accuracy"].get("samples") or []
            if not samples:
                raise ValueError(f"{name}: row {r['config']!r} at {r['context']} has no sample records")
            mine = records.setdefault(row, {})
            for s in samples:
                key = (s["task"], s["index"], s.get("seed", doc["settings"]["seed"]))
                rec = dict(s, seed=key[2])
                if key in mine and mine[key]["score"] != rec["score"]:
                    raise ValueError(f"{name}: row {r['config']!r} scored sample {key} (task, index, seed) "
                                     f"{rec['score']}, {source[row][key]} scored it {mine[key]['score']}")
                if key not in mine:
                    mine[key] = rec
                    source.setdefault(row, {})[key] = name
            parts.setdefault(row, []).append((r, len(samples)))
    seed = first["settings"]["seed"]
    results = []
    for (config, context), mine in records.items():
        ref = records.get((first["reference"], context))
        if ref is None:
            raise ValueError(f"no run has the reference row {first['reference']!r} at context {context}")
        missing = sorted(k for k in mine if k not in ref)
        if missing:
            raise ValueError(f"row {config!r} at {context}: the reference has no sample {missing[0]} "
                             f"(task, index, seed) (from {source[(config, context)][missing[0]]})")
        # in the order the runs list them: runs split by task merge to the run of all the tasks
        acc = ruler_accuracy([(ref[k], mine[k]) for k in mine], seed)
        results.append(_merged_row(parts[(config, context)], acc))
    tasks = sorted({s["task"] for mine in records.values() for s in mine.values()})
    settings = dict(first["settings"], contexts=sorted({r["context"] for r in results}), tasks=tasks,
                    samples=max(d["settings"].get("samples", 0) for d in docs),
                    seeds=sorted({k[2] for mine in records.values() for k in mine}),
                    fidelity=all(d["settings"].get("fidelity", False) for d in docs), merged_from=list(names),
                    # a run stopped early (or still going) counts with the samples it finished
                    merged_partial=[n for d, n in zip(docs, names) if d.get("partial")])
    return {"schema": report.SCHEMA, "kvtier_version": first["kvtier_version"],
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": first["model"], "settings": settings, "reference": first["reference"],
            "elapsed_s": sum(d.get("elapsed_s", 0.0) for d in docs), "results": results,
            "skipped": [s for d in docs for s in d.get("skipped", [])]}


def _merged_row(parts: list[tuple[dict, int]], acc: dict) -> dict:
    """One row from its runs' rows: the recomputed accuracy; footprint and cost averaged over
    the runs weighted by their samples (p99: the largest of the runs')."""
    base = parts[0][0]
    n = sum(w for _, w in parts)

    def mean(section: str, key: str):
        vals = [(r[section].get(key), w) for r, w in parts]
        if any(not isinstance(v, (int, float)) or isinstance(v, bool) for v, _ in vals):
            return base[section].get(key)
        return sum(v * w for v, w in vals) / n

    footprint = dict(base["footprint"])
    for key in (*_FP_MEAN, "peak_l1_bytes"):
        if key in footprint:
            footprint[key] = mean("footprint", key)
    cost = dict(base["cost"])
    for key in ("decode_tok_s", "tpot_p50_ms", "prefill_s", "ttft_s", "swap_bytes_per_token"):
        if key in cost:
            cost[key] = mean("cost", key)
    if all(isinstance(r["cost"].get("tpot_p99_ms"), (int, float)) for r, _ in parts):
        cost["tpot_p99_ms"] = max(r["cost"]["tpot_p99_ms"] for r, _ in parts)
    if all(isinstance(r["cost"].get("recalled_from"), dict) for r, _ in parts):
        cost["recalled_from"] = {t: sum(int(r["cost"]["recalled_from"].get(t, 0)) for r, _ in parts)
                                 for t in ("l1", "l2", "l3")}
    return {"config": base["config"], "kind": base["kind"], "anchor": base["anchor"], "params": base["params"],
            "context": base["context"], "accuracy": acc, "footprint": footprint, "cost": cost,
            "stats": parts[-1][0]["stats"]}


def merge_dirs(dirs: list[Path]) -> dict:
    """:func:`merge` of the ``eval.json`` in each of ``dirs``."""
    docs = []
    for d in dirs:
        path = Path(d) / "eval.json"
        try:
            docs.append(json.loads(path.read_text()))
        except FileNotFoundError:
            raise ValueError(f"--merge: {path} does not exist (a directory `kvtier eval --out` wrote)") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--merge: {path} is not JSON ({e})") from None
    return merge(docs, [str(d) for d in dirs])

