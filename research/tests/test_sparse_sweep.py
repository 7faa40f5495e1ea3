"""research/sparse_sweep.py's statistics and table, on records whose answer is known (no model)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "sparse_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("sparse_sweep", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ratio_ci_is_paired_seeded_and_brackets_the_ratio(sweep):
    ref = [1.0, 0.8, 0.9, 1.0, 0.7, 0.9]
    got = [0.5, 0.4, 0.45, 0.5, 0.35, 0.45]  # half of the reference on every window
    p, lo, hi = sweep.ratio_ci(ref, got, seed=0)
    assert p == pytest.approx(0.5) and lo == pytest.approx(0.5) and hi == pytest.approx(0.5)
    got = [1.0, 0.4, 0.9, 0.5, 0.7, 0.9]
    a, b = sweep.ratio_ci(ref, got, seed=3), sweep.ratio_ci(ref, got, seed=3)
    assert a == b and a[1] < a[0] < a[2]


def test_report_pairs_settings_with_the_reference_per_context_and_text(sweep):
    recs = []
    for text in ("pydoc", "essays"):
        for ctx in (2048, 4096):
            for w in range(2):
                base = dict(text=text, context=ctx, window=w, seed=0, l1_bytes_per_token=100.0)
                recs.append(dict(base, setting="dynamic (ref)", acc=0.8))
                recs.append(dict(base, setting="half", acc=0.4))
                recs.append(dict(base, setting="essays only", acc=0.8 if text == "essays" else 0.0))
    table = sweep.report(recs)
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
    assert "**0.50 [0.50, 0.50]**" in rows["half"]
    assert rows["essays only"].split(" | ")[4:6] == ["0.00", "1.00"]  # pydoc, essays
    assert rows["dynamic (ref) (accuracy)"].split(" | ")[-2] == "8"  # windows
