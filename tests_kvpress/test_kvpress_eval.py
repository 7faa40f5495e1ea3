"""`kvtier eval --anchors kvpress` end to end: kvpress 0.5.5's presses, run by its own pipeline in
.venv-kvpress, as rows of the same table as the reference, on the same RULER sample (SmolLM2,
1k tokens). Needs `make kvpress-venv` (`make test-kvpress` builds it)."""
from __future__ import annotations

import json

import pytest

from kvtier.commands.cli import main
from kvtier.eval import kvpress_rows


def test_presses_are_rows_of_the_same_table(tmp_path):
    try:
        kvpress_rows.venv_python()
    except ValueError as e:
        pytest.fail(str(e))
    out = tmp_path / "out"
    assert main(["eval", "--suite", "ruler", "--contexts", "1024", "--tasks", "niah_single_1", "--samples", "1",
                 "--anchors", "kvpress", "--only", "kvpress", "--dtype", "float32", "--threads", "1",
                 "--out", str(out)]) == 0
    doc = json.loads((out / "eval.json").read_text())
    rows = {r["config"]: r for r in doc["results"]}
    assert set(rows) == {"dynamic (ref)"} | {s.name for s in kvpress_rows.kvpress_configs()}
    ref = rows.pop("dynamic (ref)")
    (ref_sample,) = ref["accuracy"]["samples"]
    held = ref["footprint"]["peak_l1_bytes"] / ref["footprint"]["l1_bytes_per_token"]  # prompt + answer tokens
    for name, r in rows.items():
        assert r["kind"] == "kvpress" and r["anchor"] and r["cost"]["decode_tok_s"] > 0
        (s,) = r["accuracy"]["samples"]
        assert (s["task"], s["index"]) == (ref_sample["task"], ref_sample["index"])  # the same sample
        fp = r["footprint"]
        if r["params"]["press"] == "none":
            # full attention through kvpress's transformers: the reference's answer (which stops at
            # RULER's full score; kvpress's decode runs on to the end of the turn)
            assert s["prediction"].startswith(ref_sample["prediction"]) and s["score"] == ref_sample["score"]
            assert fp["l1_bytes_per_token"] == pytest.approx(ref["footprint"]["l1_bytes_per_token"])
            continue
        # 3% of the context's tokens kept per layer and head (the question, ~40 tokens, is not context)
        assert 0.025 * held <= fp["kept_context_tokens"] <= 0.031 * held
        assert fp["l1_bytes_per_token"] < 0.2 * ref["footprint"]["l1_bytes_per_token"]
        if r["params"]["press"] == "kvzip":  # masked by kvpress at attention time, not freed
            assert fp["held_bytes_per_token"] == pytest.approx(ref["footprint"]["l1_bytes_per_token"], rel=0.02)
    assert "kvpress SnapKV 3.0%" in (out / "eval.md").read_text()
