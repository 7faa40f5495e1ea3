import json

import pytest
import torch

from kvtier.eval import report
from kvtier.eval.data import PROBE_CUE, probe_windows, text_windows
from kvtier.eval.caches import CacheSpec
from kvtier.eval.runner import Result
from kvtier.eval.sweep import load_configs, summarise


class CharTokenizer:
    """One token per character: enough to check window arithmetic without a model."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return {"input_ids": torch.tensor([[ord(c) % 30000 for c in text]])}


TEXT = " ".join("".join(chr(97 + (i * 7 + j * 3) % 26) for j in range(4 + i % 5)) for i in range(1200))


def test_text_windows_are_consecutive_slices():
    ids = torch.arange(10_000)
    ws = text_windows(ids, 256, 16, 3, seed=1)
    assert len(ws) == 3
    for w in ws:
        assert w.context.numel() == 256 and w.continuation.numel() == 16
        assert w.continuation[0] == w.context[-1] + 1
    with pytest.raises(ValueError, match="exceeds the text"):
        text_windows(torch.arange(100), 256, 16, 1)


def test_probe_window_holds_passage_and_cue():
    tok = CharTokenizer()
    ids = tok(TEXT)["input_ids"][0]
    (w,) = probe_windows(tok, TEXT, ids, 1024, 1, words=8, seed=3)
    assert w.context.numel() == 1024
    ctx = "".join(chr(int(c)) for c in w.context)
    cont = "".join(chr(int(c)) for c in w.continuation)
    assert ctx.count(PROBE_CUE) == 2
    passage = ctx.split(PROBE_CUE)[1].split(".")[0]
    assert passage.endswith(cont)          # the scored tokens are the passage's tail
    assert ctx.endswith(passage[: len(passage) - len(cont)])
    assert 0.0 < w.depth < 1.0


def _doc(rows):
    return {"schema": report.SCHEMA, "kvtier_version": "0", "created": "now", "model": {"name": "m"},
            "settings": {}, "reference": "ref", "results": rows}


def test_summarise_reference_against_itself_and_schema(tmp_path):
    lp = torch.log_softmax(torch.randn(8, 20), dim=-1)
    w_text = text_windows(torch.arange(1000) % 20, 64, 8, 1)[0]
    w_probe = type(w_text)("probe", w_text.context, lp.argmax(1)[:8])
    fp = {"l1_bytes_per_token": 10.0, "l2_bytes_per_token": 0.0, "l3_bytes_per_token": 0.0,
          "total_bytes_per_token": 10.0, "peak_l1_bytes": 640.0}
    spec = CacheSpec("ref", "dynamic")
    res = [Result(spec, w_text, [0.01, 0.02], 0.1, 0.0, fp, {}, logp=lp),
           Result(spec, w_probe, [0.01], 0.1, 0.0, fp, {}, logp=lp)]
    row = summarise(spec, 64, res, res)
    a = row["accuracy"]
    assert a["ppl_rel_change"] == 0 and a["kl_mean"] == pytest.approx(0) and a["top1_agreement"] == 1
    assert a["probe_acc"] == a["probe_acc_ref"] == 1.0 and a["probe_rel"] == 1.0
    assert a["diff"]["probe_acc"]["mean"] == 0 and a["diff"]["probe_acc"]["within_ci"]
    assert a["ci"]["ppl_rel_change"]["lo"] == a["ci"]["ppl_rel_change"]["hi"] == 0
    doc = _doc([row])
    report.write_json(doc, tmp_path / "e.json")
    back = json.loads((tmp_path / "e.json").read_text())
    report.validate(back)
    report.plot(back, tmp_path / "e.png")
    assert (tmp_path / "e.png").stat().st_size > 1000
    assert "ref" in report.markdown_table(back)


def test_validate_rejects_broken_documents():
    with pytest.raises(ValueError, match="schema"):
        report.validate({"schema": "other"})
    with pytest.raises(ValueError, match="results"):
        report.validate(_doc([]))
    with pytest.raises(ValueError, match=r"results\[0\] misses"):
        report.validate(_doc([{"config": "x"}]))


def test_config_file_errors(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[[config]]\nname = "a"\nkind = "bogus"\n')
    with pytest.raises(ValueError, match="'kind' must be one of"):
        load_configs(p)
    p.write_text('[[config]]\nname = "a"\nkind = "quanto"\n[[config]]\nname = "a"\nkind = "hqq"\n')
    with pytest.raises(ValueError, match="unique"):
        load_configs(p)
    p.write_text("not toml [")
    with pytest.raises(ValueError, match="cannot read TOML"):
        load_configs(p)
    with pytest.raises(ValueError, match="kind must be one of"):
        CacheSpec("x", "nope")


def test_cli_rejects_bad_options(capsys):
    from kvtier.commands.cli import main

    with pytest.raises(SystemExit) as e:
        main(["eval", "--contexts", "12"])
    assert e.value.code == 2
    assert "--contexts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--windows", "0"])
    assert "--windows" in capsys.readouterr().err


def test_full_sweep_configs_check_and_hold_an_importance_row():
    from kvtier.eval.sweep import check_configs, full_configs

    specs = full_configs()
    check_configs(specs, [1024, 4096])
    imp = [s for s in specs if s.params.get("precision") == "importance"]
    assert imp and all(s.params["policy"] == "h2o" for s in imp)


def test_the_plot_names_points_by_a_legend_of_distinct_markers(tmp_path):
    names = [f"kvtier int4 sparse L1={p}%" for p in range(24)]
    rows = [{"config": n, "kind": "kvtier", "anchor": i < 3, "params": {}, "context": ctx,
             "accuracy": {"ruler": 1.0, "ci": {"ruler": {"lo": 0.5, "hi": 1.0}}},
             "footprint": {"l1_bytes_per_token": 1000 + i}, "cost": {}, "stats": {}}
            for ctx in (8192, 16384) for i, n in enumerate(names)]  # near-identical points
    style = report._styles(rows)
    assert list(style) == names and len(set(style.values())) == len(names), "one look per configuration"
    assert all((style[n][1] == "s") == (i < 3) for i, n in enumerate(names)), "squares: anchors"
    doc = dict(_doc(rows), settings={"suite": "ruler", "tasks": ["niah_single_1"]})
    report.plot(doc, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000
