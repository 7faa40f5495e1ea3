"""`kvtier eval --merge`: runs split over processes or seeds read back as one run."""
from __future__ import annotations

import json

import pytest

from kvtier.commands.cli import main
from kvtier.eval import report
from kvtier.eval.merge import merge

ONLY = "kvtier int4 sparse L1=12.5%"


def _eval(tmp_path, name, tasks, *extra):
    out = tmp_path / name
    argv = ["eval", "--suite", "ruler", "--tasks", tasks, "--contexts", "512", "--samples", "2",
            "--only", ONLY, "--threads", "1", "--out", str(out), *extra]
    assert main(argv) == 0
    return out


def test_runs_split_by_task_merge_to_the_run_of_all_tasks(tmp_path):
    """Two halves, merged: the same rows, samples, scores and intervals as one run of both halves."""
    whole = json.loads((_eval(tmp_path, "whole", "extract_digits,extract_words") / "eval.json").read_text())
    a = _eval(tmp_path, "a", "extract_digits")
    b = _eval(tmp_path, "b", "extract_words")
    out = tmp_path / "merged"
    assert main(["eval", "--merge", str(a), str(b), "--out", str(out)]) == 0
    merged = json.loads((out / "eval.json").read_text())
    report.validate(merged)
    assert (out / "eval.md").exists() and (out / "eval.png").exists()
    assert [(r["config"], r["context"]) for r in merged["results"]] == \
        [(r["config"], r["context"]) for r in whole["results"]]
    for m, w in zip(merged["results"], whole["results"]):
        assert m["accuracy"]["samples"] == w["accuracy"]["samples"]
        for key in ("ruler", "ruler_ref", "ruler_rel", "ruler_tasks", "partial", "ci", "diff"):
            assert m["accuracy"][key] == w["accuracy"][key], key
        assert m["footprint"]["total_bytes_per_token"] > 0
    assert merged["settings"]["merged_from"] == [str(a), str(b)]
    assert merged["settings"]["tasks"] == ["extract_digits", "extract_words"]


def _doc(seed=0, scores=(1.0, 0.0), ref_scores=(1.0, 1.0), task="niah_single_1", suite="ruler", dtype="float32"):
    def row(name, sc, anchor):
        samples = [{"task": task, "index": i, "seed": seed, "score": s, "partial": s, "prediction": "x"}
                   for i, s in enumerate(sc)]
        return {"config": name, "kind": "dynamic" if anchor else "kvtier", "anchor": anchor, "params": {},
                "context": 4096, "accuracy": {"ruler": sum(sc) / len(sc), "samples": samples},
                "footprint": {"l1_bytes_per_token": 10.0, "total_bytes_per_token": 20.0},
                "cost": {"decode_tok_s": 5.0, "tpot_p50_ms": 200.0, "tpot_p99_ms": 250.0 + seed}, "stats": {}}
    return {"schema": report.SCHEMA, "kvtier_version": "0", "created": "2026-12-06T00:00:00+00:00",
            "model": {"name": "m", "dtype": dtype}, "settings": {"suite": suite, "contexts": [4096], "seed": seed,
                                                                  "tasks": [task], "samples": 2},
            "reference": "ref", "elapsed_s": 1.0,
            "results": [row("ref", ref_scores, True), row("row", scores, False)]}


def test_samples_of_other_seeds_stay_apart_and_intervals_cover_all():
    merged = merge([_doc(seed=0), _doc(seed=1, scores=(1.0, 1.0))], ["s0", "s1"])
    ref, row = merged["results"]
    assert [(s["index"], s["seed"]) for s in row["accuracy"]["samples"]] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert row["accuracy"]["ruler"] == 0.75 and row["accuracy"]["ci"]["ruler"]["n"] == 4
    assert row["accuracy"]["ruler_rel"] == 0.75 and ref["accuracy"]["ruler_rel"] == 1.0
    assert row["cost"]["tpot_p99_ms"] == 251.0 and merged["settings"]["seeds"] == [0, 1]
    # a record written before samples named their seed takes its run's
    old = _doc(seed=2)
    for r in old["results"]:
        for s in r["accuracy"]["samples"]:
            del s["seed"]
    assert {s["seed"] for s in merge([_doc(seed=0), old], ["a", "b"])["results"][1]["accuracy"]["samples"]} == {0, 2}


def test_the_same_sample_twice_counts_once_and_a_different_score_is_refused():
    same = merge([_doc(), _doc()], ["a", "b"])
    assert same["results"][1]["accuracy"]["ci"]["ruler"]["n"] == 2
    with pytest.raises(ValueError, match=r"b: row 'row' scored sample \('niah_single_1', 1, 0\).*1.0, a scored it 0.0"):
        merge([_doc(), _doc(scores=(1.0, 1.0))], ["a", "b"])


def test_runs_that_cannot_be_merged_are_refused_by_name():
    with pytest.raises(ValueError, match="b: only ruler-suite runs"):
        merge([_doc(), _doc(suite="text")], ["a", "b"])
    with pytest.raises(ValueError, match="b: model dtype 'bfloat16' differs from a's 'float32'"):
        merge([_doc(), _doc(dtype="bfloat16")], ["a", "b"])
    other = _doc(seed=1)
    other["reference"] = "row"
    with pytest.raises(ValueError, match="b: reference row 'row' differs"):
        merge([_doc(), other], ["a", "b"])
    lacking = _doc(seed=1)
    lacking["results"][0]["accuracy"]["samples"].pop()
    with pytest.raises(ValueError, match=r"the reference has no sample \('niah_single_1', 1, 1\)"):
        merge([_doc(), lacking], ["a", "b"])
    with pytest.raises(ValueError, match="at least two runs"):
        merge([_doc()], ["a"])


def test_merge_cli_checks_its_arguments(tmp_path, capsys):
    for name, doc in (("a", _doc()), ("b", _doc(seed=1))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "eval.json").write_text(json.dumps(doc))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    before = (tmp_path / "a" / "eval.json").read_text()

    def refused(*argv):
        with pytest.raises(SystemExit) as e:
            main(["eval", "--merge", *argv])
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "--merge takes no other option than --out" in refused(a, b, "--tasks", "niah_single_1",
                                                                 "--out", str(tmp_path / "m"))
    assert "is one of the --merge directories" in refused(a, b, "--out", a)
    assert "eval.json does not exist" in refused(a, str(tmp_path / "none"), "--out", str(tmp_path / "m"))
    assert (tmp_path / "a" / "eval.json").read_text() == before and not (tmp_path / "m").exists()
    assert main(["eval", "--merge", a, b, "--out", str(tmp_path / "m")]) == 0
    assert json.loads((tmp_path / "m" / "eval.json").read_text())["settings"]["merged_from"] == [a, b]
