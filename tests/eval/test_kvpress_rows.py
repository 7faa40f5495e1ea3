"""kvpress anchor rows, main-venv side: their configuration, the context|question split, and the
runner's output turned into rows of the same table (kvpress itself runs in tests_kvpress/)."""
from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvtier.eval import kvpress_rows, report
from kvtier.eval.caches import KVPRESS_PRESSES, CacheSpec
from kvtier.eval.sweep import REFERENCE, check_configs, load_configs, summarise

needs_ruler = pytest.mark.skipif(importlib.util.find_spec("long_context_eval") is None,
                                 reason="RULER's package is not installed (make installs it)")


def test_configs_at_the_budget_and_their_checks(tmp_path):
    specs = kvpress_rows.kvpress_configs(0.03)
    check_configs(specs, [8192])
    assert [s.params["press"] for s in specs] == ["none", "snapkv", "expected_attention", "kvzip", "streaming_llm"]
    assert all(s.anchor and not s.reuses_prefill for s in specs)
    assert [round(kvpress_rows.compression_ratio(s), 6) for s in specs] == [0.0] + [0.97] * 4
    assert specs[1].name == "kvpress SnapKV 3.0%"
    p = tmp_path / "c.toml"
    p.write_text('[[config]]\nname = "p"\nkind = "kvpress"\npress = "kvzip"\nbudget_fraction = 0.015\n')
    (spec,) = load_configs(p)
    check_configs([spec], [8192])
    assert kvpress_rows.compression_ratio(spec) == pytest.approx(0.985)
    for params, msg in [({"press": "h2o"}, "press must be one of"), ({"press": "snapkv", "window": 8}, "unknown key"),
                        ({"press": "snapkv", "budget_fraction": 1.5}, "budget_fraction must be a fraction"),
                        ({"press": "none", "budget_fraction": 0.5}, "drop budget_fraction")]:
        with pytest.raises(ValueError, match=msg):
            CacheSpec("x", "kvpress", params).check([8192])


def test_runner_presses_match_and_it_imports_nothing_of_kvtier():
    src = Path(kvpress_rows._RUNNER).read_text()
    imported = {a.name.split(".")[0] for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom) and n.module}
    assert "kvtier" not in imported  # it runs in kvpress's venv, where kvtier's transformers is absent
    spec = importlib.util.spec_from_file_location("kvpress_runner_under_test", kvpress_rows._RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)  # torch only at import; kvpress is imported inside make_press
    assert tuple(runner.PRESSES) == KVPRESS_PRESSES == tuple(kvpress_rows.PRESSES)


def test_missing_venv_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv(kvpress_rows.VENV_ENV, str(tmp_path / "no-python"))
    with pytest.raises(ValueError, match="make kvpress-venv"):
        kvpress_rows.venv_python()


def test_cli_refuses_kvpress_rows_outside_ruler_and_without_venv(capsys, monkeypatch, tmp_path):
    import kvtier.models as model_mod
    from kvtier.commands.cli import main

    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: pytest.fail("model loaded before the checks"))
    monkeypatch.setenv(kvpress_rows.VENV_ENV, str(tmp_path / "no-python"))
    for argv, msg in [(["--anchors", "kvpress"], "need --suite ruler"),
                      (["--suite", "ruler", "--tasks", "niah_single_1", "--anchors", "kvpress"], "make kvpress-venv")]:
        if "ruler" in argv and importlib.util.find_spec("long_context_eval") is None:
            continue
        with pytest.raises(SystemExit) as e:
            main(["eval", *argv, "--out", str(tmp_path / "out")])
        assert e.value.code == 2
        assert msg in capsys.readouterr().err


def _sample(tokenizer, task="niah_single_1", needle="4938211"):
    """A RULER-shaped niah sample: RULER's template (as niah.py rewords it for one needle) in the
    model's chat template, a haystack with the needle, RULER's answer prefix."""
    from kvtier.eval import ruler

    consts = importlib.import_module(f"{ruler._PACKAGE}.data.synthetic.constants").TASKS["niah"]
    single = consts["template"].replace("Some", "A").replace("are all", "is").replace("are", "is")
    hay = "The grass is green. The sky is blue.\n" * 8 + f"One of the special magic numbers for x is: {needle}.\n"
    task_text = single.format(type_needle_v="number", context=hay.strip(), query="x")
    prefix = consts["answer_prefix"].replace("are", "is").format(type_needle_v="number", query="x")
    prompt = ruler.chat_template(tokenizer).format(task_template=task_text) + prefix
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    return ruler.Sample(task, 0, prompt, [needle], 128, "niah", ids.long())


@needs_ruler
def test_question_split_keeps_the_samples_tokens(tokenizer):
    s = _sample(tokenizer)
    k = kvpress_rows.question_start(s, tokenizer)
    question = tokenizer.decode(s.input_ids[k:])
    assert question.startswith("What is the special magic number for x")
    assert question.endswith("mentioned in the provided text is")       # the answer prefix rides with it
    assert "4938211" in tokenizer.decode(s.input_ids[:k])               # the needle is in the context
    job = kvpress_rows.job(kvpress_rows.kvpress_configs(), [s], tokenizer, Path("/m"), "float32", 1)
    assert job["samples"][0]["input_ids"] == s.input_ids.tolist() and job["samples"][0]["question_start"] == k
    assert set(job["stop_ids"]) >= {tokenizer.eos_token_id}
    assert [p["compression_ratio"] for p in job["presses"]][1] == pytest.approx(0.97)
    assert not any(p["compress_question"] for p in job["presses"])
    aware = CacheSpec("q", "kvpress", {"press": "snapkv", "compress_question": True})
    aware.check([8192])
    assert kvpress_rows.job([aware], [s], tokenizer, Path("/m"), "float32", 1)["presses"][0]["compress_question"]
    with pytest.raises(ValueError, match="compress_question must be true or false"):
        CacheSpec("q", "kvpress", {"press": "snapkv", "compress_question": "yes"}).check([8192])


def _ref_result(sample, tokenizer, score):
    from kvtier.eval.runner import Result

    fp = {"l1_bytes_per_token": 100.0, "l2_bytes_per_token": 0.0, "l3_bytes_per_token": 0.0,
          "total_bytes_per_token": 100.0, "peak_l1_bytes": 1e4}
    return Result(REFERENCE, sample, [0.01, 0.01], 1.0, 0.0, fp, {}, prediction="", score=score)


@needs_ruler
def test_runner_output_becomes_rows_of_the_same_table(tokenizer):
    samples = [_sample(tokenizer, needle="4938211"), _sample(tokenizer, needle="1234567")]
    specs = kvpress_rows.kvpress_configs(0.03, presses=("none", "snapkv"))
    eos = tokenizer.eos_token_id
    answer = lambda n: tokenizer.encode(f" {n}.", add_special_tokens=False) + [eos]  # noqa: E731
    lines = [json.dumps({"name": specs[0].name, "sample": i, "tokens": answer(n), "prefill_s": 2.0,
                         "step_s": [0.02] * 4, "kv_bytes": 8000, "kept_tokens": 90, "context_tokens": 90,
                         "question_tokens": 30}) for i, n in enumerate(["4938211", "1234567"])]
    lines += [json.dumps({"name": specs[1].name, "sample": i, "tokens": answer(n), "prefill_s": 2.5,
                          "step_s": [0.01] * 4, "kv_bytes": 800, "kept_tokens": 3, "context_tokens": 90,
                          "question_tokens": 30}) for i, n in enumerate(["4938211", "0000000"])]
    got = kvpress_rows.results(specs, samples, lines, tokenizer)
    assert [r.score for r in got[specs[0].name]] == [1.0, 1.0]
    assert [r.score for r in got[specs[1].name]] == [1.0, 0.0]      # RULER's metric on the decoded answer
    assert eos not in tokenizer.encode(got[specs[1].name][0].prediction, add_special_tokens=False)
    ref = [_ref_result(s, tokenizer, 1.0) for s in samples]
    rows = [summarise(REFERENCE, 128, ref, ref)] + [summarise(s, 128, ref, got[s.name]) for s in specs]
    snap = rows[2]
    assert snap["kind"] == "kvpress" and snap["anchor"] and snap["accuracy"]["ruler"] == 0.5
    assert snap["accuracy"]["diff"]["ruler"]["mean"] == -0.5                       # paired against the reference
    tokens = samples[0].input_ids.numel() + 4
    assert snap["footprint"]["l1_bytes_per_token"] == pytest.approx(800 / tokens)  # the cache after decoding
    assert snap["cost"]["decode_tok_s"] == pytest.approx(100.0) and snap["cost"]["ttft_s"] == 2.5
    doc = {"schema": report.SCHEMA, "kvtier_version": "t", "created": "t", "model": {"name": "m"},
           "settings": {"suite": "ruler", "tasks": ["niah_single_1"]}, "reference": REFERENCE.name, "results": rows}
    report.validate(doc)
    table = report.markdown_table(doc)
    assert "| * kvpress SnapKV 3.0% | 50.0 [" in table and "| * kvpress full (no press) | 100.0" in table


@needs_ruler
def test_a_missing_result_is_an_error(tokenizer):
    specs = kvpress_rows.kvpress_configs(0.03, presses=("snapkv",))
    with pytest.raises(RuntimeError, match="no result"):
        kvpress_rows.results(specs, [_sample(tokenizer)], [], tokenizer)
