"""The RULER adapter: RULER's own generators and scoring, and the errors of its options."""
from __future__ import annotations

import importlib.util

import pytest

from kvtier.eval import ruler

pytestmark = pytest.mark.skipif(importlib.util.find_spec("long_context_eval") is None,
                                reason="RULER's package is not installed (make installs it)")


def _ruler_metric(kind):
    spec = importlib.util.spec_from_file_location(
        "ruler_metrics_under_test", ruler.package_dir() / "eval" / "synthetic" / "constants.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TASKS[kind]["metric_fn"]


@pytest.mark.parametrize("kind, outputs, prediction", [
    ("niah", ["4938211"], " 4938211.\n"),
    ("niah", ["1111111", "2222222", "3333333", "4444444"], "The numbers are 2222222, 4444444 and 9"),
    ("niah", ["09e9db0a-df46-4290-a1ee-411a1bac27a7"], "09E9DB0A-DF46-4290-A1EE-411A1BAC27A7"),
    ("variable_tracking", ["ABCDE", "FGHIJ"], "ABCDE FGHI"),
    ("common_words_extraction", ["apple", "pear"], "1. apple 2. plum"),
    ("freq_words_extraction", ["rczbnn", "rhrmlh", "hmcxdl"], "rczbnn, HMCXDL and rhrmlh"),
    ("qa", ["France", "the French Republic"], "\x01 france\x1f"),
    ("qa", ["yes"], "no"),
    ("niah", ["123"], ""),
])
def test_score_is_rulers_metric_on_the_same_output(kind, outputs, prediction):
    # RULER: postprocess_pred (strip, control characters to newlines), then metric_fn in percent
    import re

    pred = re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()
    expected = _ruler_metric(kind)([pred], [outputs]) / 100
    assert ruler.score(kind, prediction, outputs) == expected


def test_split_sentences_keeps_every_character():
    text = 'It was late. "Really?" he asked. The U.S. is big! 3 cats (and a dog.) Ran off.'
    parts = ruler.split_sentences(text)
    assert len(parts) >= 4
    assert " ".join(parts) == text


@pytest.mark.slow  # RULER's niah.py builds its word list (~7M strings) on every run: ~15-60 s
def test_generate_builds_rulers_prompt_and_answers(tokenizer, tmp_path):
    from kvtier.models import model_dir

    a = ruler.generate("niah_single_1", tokenizer, model_dir(), 512, 2, seed=42, cache_dir=tmp_path)
    b = ruler.generate("niah_single_1", tokenizer, model_dir(), 512, 2, seed=42, cache_dir=tmp_path)
    assert [s.prompt for s in a] == [s.prompt for s in b]          # kept: the same samples
    for s in a:
        assert s.metric == "niah" and s.max_new_tokens == 128
        assert len(s.outputs) == 1 and s.outputs[0] in s.prompt      # the needle is in the haystack
        assert "special magic number" in s.prompt
        assert s.input_ids.numel() + s.max_new_tokens <= 512         # RULER's length budget
        assert ruler.score(s, f"The number is {s.outputs[0]}.") == 1.0


def test_missing_data_names_the_task_before_anything_runs(monkeypatch, tmp_path):
    import shutil

    real = ruler.package_dir()
    (tmp_path / "data" / "synthetic" / "json").mkdir(parents=True)
    shutil.copy(real / "synthetic.yaml", tmp_path / "synthetic.yaml")
    for script in ("niah.py", "qa.py"):
        shutil.copy(real / "data" / "synthetic" / script, tmp_path / "data" / "synthetic" / script)
    monkeypatch.setattr(ruler, "package_dir", lambda: tmp_path)
    assert ruler.check_tasks(["niah_single_1"]) == ["niah_single_1"]   # noise haystack: no data file
    with pytest.raises(ValueError, match=r"--tasks niah_single_2: RULER's PaulGrahamEssays.json is missing"):
        ruler.check_tasks(["niah_single_1", "niah_single_2"])
    with pytest.raises(ValueError, match=r"--tasks qa_2: RULER's hotpotqa.json is missing"):
        ruler.check_tasks(["qa_2"])
    with pytest.raises(ValueError, match=r"--tasks vt: RULER's variable_tracking.py is missing"):
        ruler.check_tasks(["vt"])


def test_unknown_task_and_missing_package_name_the_option(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"--tasks: unknown RULER task\(s\) \['niah_single_9'\]"):
        ruler.check_tasks(["niah_single_1", "niah_single_9"])
    monkeypatch.setattr(ruler, "package_dir", lambda: tmp_path)
    with pytest.raises(ValueError, match="--text essays"):
        ruler.essays_text()
    monkeypatch.setattr(ruler, "_PACKAGE", "no_such_package_here")
    monkeypatch.undo()
    monkeypatch.setattr(ruler, "_PACKAGE", "no_such_package_here")
    with pytest.raises(ValueError, match="--suite ruler needs RULER's package"):
        ruler.package_dir()
