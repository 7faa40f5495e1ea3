"""`kvtier eval` refuses bad options with a sentence and exit code 2, before any model loads."""
from __future__ import annotations

import pytest

import kvtier.models as model_mod
from kvtier.commands.cli import main


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")
    monkeypatch.setattr(model_mod, "load_model", refuse)


def _err(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(["eval", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_files(capsys, tmp_path):
    assert "--text" in _err(capsys, "--text", str(tmp_path / "missing.txt"))
    f = tmp_path / "file"
    f.write_text("x")
    assert "--out" in _err(capsys, "--out", str(f))
    assert "--out" in _err(capsys, "--out", str(f / "under-a-file"))  # a directory that cannot be made
    assert "--prefill-cache" in _err(capsys, "--prefill-cache", str(f))
    assert "--configs" in _err(capsys, "--configs", str(tmp_path / "none.toml"))


def test_config_rows_checked_up_front(capsys, tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[[config]]\nname = "ok"\nkind = "quanto"\nnbits = 4\n'
                 '[[config]]\nname = "bad"\nkind = "kvtier"\ncodec = "int9"\n')
    err = _err(capsys, "--configs", str(p))
    assert "'bad'" in err and "codec" in err
    p.write_text('[[config]]\nname = "big"\nkind = "kvtier"\nhot_fraction = 7\n')
    assert "hot_fraction must be a fraction in (0, 1]" in _err(capsys, "--configs", str(p))
    p.write_text('[[config]]\nname = "q"\nkind = "quanto"\nnbits = 3\n')
    assert "nbits must be one of" in _err(capsys, "--configs", str(p))


def test_contexts_only_tasks_model(capsys):
    assert "8,192 positions" in _err(capsys, "--contexts", "16384")
    assert "32,768 positions" in _err(capsys, "--model", "qwen2.5-coder-0.5b", "--contexts", "40000")
    assert "matches no configuration" in _err(capsys, "--only", "no-such-row")
    assert "neither an embedded model" in _err(capsys, "--model", "no-such-model")


def test_fidelity_needs_the_ruler_suite(capsys, tmp_path):
    assert "--fidelity needs --suite ruler" in _err(capsys, "--suite", "text", "--fidelity", "--out", str(tmp_path / "o"))


def test_ruler_task_names(capsys):
    pytest.importorskip("long_context_eval")
    assert "--tasks: unknown RULER task" in _err(capsys, "--suite", "ruler", "--tasks", "niah_single_9")


def test_short_text_before_model_loads(capsys, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("only a few words here")
    assert "exceeds the text" in _err(capsys, "--text", str(f), "--contexts", "1024", "--out", str(tmp_path / "o"))


def test_model_names_and_paths():
    from kvtier.models import MODELS, resolve_model

    assert resolve_model(None) == (None, MODELS["smollm2-135m"])
    assert resolve_model("qwen2.5-coder-0.5b") == (None, MODELS["qwen2.5-coder-0.5b"])
    assert MODELS["qwen2.5-coder-0.5b"].max_positions == 32768
    assert resolve_model("/some/dir") == ("/some/dir", None)


def test_gguf_path_positions_read_before_the_model_loads(capsys, tmp_path):
    from kvtier.models import find_gguf

    assert "8,192 positions" in _err(capsys, "--model", str(find_gguf()), "--contexts", "16384")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file" * 16)
    assert "cannot read it as a GGUF file" in _err(capsys, "--model", str(bad))


def test_a_row_with_the_former_hot_fraction_builds_the_same_config_and_warns():
    import warnings

    from kvtier.eval.caches import CacheSpec, kvtier_config

    new = kvtier_config(CacheSpec("r", "kvtier", {"device_fraction": 0.25, "attention": "sparse"}), 4096)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = kvtier_config(CacheSpec("r", "kvtier", {"hot_fraction": 0.25, "attention": "sparse"}), 4096)
    assert old == new and new.device_tokens == 1024
    assert any(issubclass(w.category, DeprecationWarning) and "device_fraction" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="set device_fraction only"):
        kvtier_config(CacheSpec("r", "kvtier", {"hot_fraction": 0.25, "device_fraction": 0.25}), 4096)
