"""`kvtier generate` on the real model: the summary from today's stats(), a per-run L3
directory by default, and a directory in use as a sentence with exit code 2."""
from __future__ import annotations

import os
import tempfile

import pytest

from kvtier.commands.cli import main


@pytest.fixture
def loaded(monkeypatch, model, tokenizer):
    """generate uses the session's float32 model instead of loading its own."""
    import kvtier.models as m

    monkeypatch.setattr(m, "load_model", lambda *a, **kw: (model, tokenizer))


def _scratch_dirs() -> set[str]:
    return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("kvtier-generate-")}


def test_generate_prints_a_real_summary_and_leaves_no_directory(loaded, capsys):
    before = _scratch_dirs()
    assert main(["generate", "--prompt", "Say hi.", "--prompt", "Again.", "--max-new-tokens", "4",
                 "--block-tokens", "16", "--device-tokens", "32", "--codec", "int8"]) == 0
    out = capsys.readouterr().out
    summary = out[out.index("-- kvtier cache --"):]
    conv = int(summary.split("conversation", 1)[1].split("tokens")[0].replace(",", ""))
    assert conv > 32 and "over 2 turns, 1 sequence" in summary
    assert "L1 device" in summary and "L2 host" in summary and "(int8)" in summary
    assert "swapped out" in summary and "hits/misses" in summary
    assert _scratch_dirs() == before  # the per-run L3 directory was removed


def test_two_runs_on_one_directory_give_a_sentence(loaded, tmp_path, capsys):
    from kvtier.tiers import DiskTier

    held = DiskTier(str(tmp_path / "l3"), capacity_bytes=8 << 20, segment_bytes=1 << 20)
    try:
        with pytest.raises(SystemExit) as ei:
            main(["generate", "--prompt", "hi", "--max-new-tokens", "2", "--disk-path", str(tmp_path / "l3")])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert "is in use by another kvtier process" in err and "--disk-path" in err
    finally:
        held.close()
    # the default (a per-run directory) never meets another run's lock
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "2"]) == 0
