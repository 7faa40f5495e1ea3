"""Long-answer extraction tasks: deterministic samples that fit the context, asked values that
straddle a block boundary, and the exact and prefix scores. Tokenizer only, no model."""
from __future__ import annotations

import re

import pytest

from kvtier.eval import extract
from kvtier.eval.metrics import ratio_ci


@pytest.mark.parametrize("density", [1.0, extract.DENSITY])
@pytest.mark.parametrize("kind", extract.EXTRACT_TASKS)
def test_samples_fit_cross_blocks_and_repeat(tokenizer, kind, density):
    context = 1024
    a = extract.generate(kind, tokenizer, context, 2, seed=7, density=density)
    b = extract.generate(kind, tokenizer, context, 1, seed=7, density=density)
    assert a[0].prompt == b[0].prompt and a[0].outputs == b[0].outputs  # seeded per sample, not per n
    assert a[0].prompt != a[1].prompt
    c = extract.generate(kind, tokenizer, context, 1, seed=8, density=density)
    assert c[0].outputs != a[0].outputs
    for s in a:
        n = s.input_ids.numel()
        assert context - s.max_new_tokens - 80 <= n <= context - s.max_new_tokens  # filled, not overfilled
        assert len(s.outputs) == (3 if kind == "extract_multi" else 1)
        lines = re.findall(r"^(.+) => (.+)$", s.prompt, flags=re.M)
        values = [v for _, v in lines]
        # look-alike records: records only, 14 at 1k for hex (hundreds at 8k); at the default
        # density a tenth of that among essay text, at least two besides the asked ones
        assert len(lines) >= (10 if density == 1.0 else len(s.outputs) + 2)
        for o in s.outputs:
            assert values.count(o) == 1  # the asked value appears once, as a record's value
            assert 18 <= len(o) <= 36
        # every asked value's tokens straddle a 16-token block boundary
        assert all(extract.crosses(sp, 16) for sp in extract.value_spans(tokenizer, s.prompt, s.outputs))
        keys = dict(lines)
        asked = [k for k, v in lines if v in s.outputs]
        assert all(k in s.prompt.split("=> " + keys[k])[-1] for k in asked)  # the question names each key


def test_density_puts_essay_text_between_fewer_records(tokenizer):
    dense = extract.generate("extract_digits", tokenizer, 4096, 1, seed=5, density=1.0)[0]
    sparse = extract.generate("extract_digits", tokenizer, 4096, 1, seed=5)[0]
    n_dense, n_sparse = (len(re.findall(r"^.+ => .+$", s.prompt, flags=re.M)) for s in (dense, sparse))
    assert n_sparse == round(extract.DENSITY * n_dense)
    # the records are spread through the essay passages, not bunched, and the prompt is as full
    # as the records-only one
    assert sum(len(p) > 200 for p in re.split(r"^.+ => .+$", sparse.prompt, flags=re.M)) >= 3
    assert abs(sparse.input_ids.numel() - dense.input_ids.numel()) <= 80
    with pytest.raises(ValueError, match="--extract-density"):
        extract.generate("extract_digits", tokenizer, 4096, 1, seed=5, density=0.0)


def test_block_size_is_honoured(tokenizer):
    s = extract.generate("extract_hex", tokenizer, 1024, 1, seed=3, block_tokens=32)[0]
    assert extract.crosses(extract.value_spans(tokenizer, s.prompt, s.outputs)[0], 32)


def test_bad_inputs_name_the_option(tokenizer):
    with pytest.raises(ValueError, match="--tasks"):
        extract.generate("extract_nope", tokenizer, 1024, 1, seed=0)
    with pytest.raises(ValueError, match="--contexts"):
        extract.generate("extract_hex", tokenizer, 256, 1, seed=0)


def test_exact_and_partial_scores():
    outs = ["d6e0036b-923a-d87c-93f5", "KAZFIJ-WZVMT2"]
    assert extract.exact(outs, "d6e0036b-923a-d87c-93f5\nKAZFIJ-WZVMT2") == 1.0
    assert extract.exact(outs, "d6e0036b-923a-d87c-93f5\nkazfij-wzvmt2") == 0.5  # case-sensitive
    # the copy drifted after 6 characters of the first value; the second is absent
    p = extract.partial(outs, "d6e003f1-0000 and nothing")
    assert p == pytest.approx((6 / 23 + 0) / 2)
    assert extract.partial(outs, "".join(outs)) == 1.0


def test_ratio_interval_is_paired():
    ref = [1, 1, 1, 1, 0, 1, 1, 1]
    same = ratio_ci(ref, ref, seed=0)
    assert same["mean"] == 1.0 and same["lo"] == same["hi"] == 1.0
    half = ratio_ci(ref, [1, 0, 1, 0, 0, 1, 0, 1], seed=0)
    assert half["mean"] == pytest.approx(4 / 7) and half["lo"] < 4 / 7 < half["hi"] <= 1.0
    with pytest.raises(ValueError, match="same length"):
        ratio_ci([1], [1, 1], seed=0)


def test_eval_runs_an_extraction_task_end_to_end(tmp_path):
    import json

    from kvtier.commands.cli import main

    out = tmp_path / "out"
    argv = ["eval", "--suite", "ruler", "--tasks", "extract_words", "--contexts", "512", "--samples", "2",
            "--only", "kvtier int4 sparse L1=12.5%", "--threads", "1", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "eval.json").read_text())
    rows = {r["config"]: r["accuracy"] for r in doc["results"]}
    assert set(rows) == {"dynamic (ref)", "kvtier int4 sparse L1=12.5%"}
    for acc in rows.values():
        assert [(s["task"], s["seed"]) for s in acc["samples"]] == [("extract_words", 0)] * 2
        assert all(0.0 <= s["partial"] <= 1.0 and s["score"] in (0.0, 1.0) for s in acc["samples"])
        assert acc["partial"] == sum(s["partial"] for s in acc["samples"]) / 2
    assert "× ref [95% CI]" in (out / "eval.md").read_text()
