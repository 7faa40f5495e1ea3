import argparse
import json

import pytest

from kvtier import plan


def parse(*argv):
    p = argparse.ArgumentParser()
    plan.add_arguments(p)
    return p.parse_args(list(argv))


def test_seed_formula_and_ratio_in_range():
    out = plan.make_plan(layers=30, kv_heads=3, head_dim=64, dtype="float16", concurrency=8,
                         avg_seq_len=8192, max_seq_len=32768, codec="int4")
    assert out["bytes_per_token"]["full"] == 2 * 30 * 3 * 64 * 2
    assert out["bytes_per_sequence"]["max_full"] == 2 * 30 * 3 * 64 * 2 * 32768
    # int4 with its scales/zeros: between 1/4 and 1/2 of fp16
    assert 2.0 < out["bytes_per_token"]["codec_ratio"] < 4.0
    t = out["tiers"]
    assert t["ratio_in_range"] and 4.0 <= t["dram_to_hbm"] <= 8.0
    assert t["l3_ssd_bytes"] >= out["bytes_per_sequence"]["max_codec"] * 8 - 1
    assert out["config"]["hot_tokens"] % 64 == 0


def test_hbm_given_reports_ratio():
    out = plan.make_plan(30, 3, 64, "float16", 4, 4096, 8192, "int8", hbm_bytes=8 << 20)
    assert out["tiers"]["l1_hbm_bytes"] <= 8 << 20
    assert not out["tiers"]["ratio_in_range"]  # small HBM: DRAM far more than 8x
    with pytest.raises(ValueError, match="hbm_bytes"):
        plan.make_plan(30, 3, 64, "float16", 4, 4096, 8192, "int8", hbm_bytes=1 << 20)


def test_cli_from_transformers_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
        "torch_dtype": "bfloat16"}))
    assert plan.run(parse("--config", str(tmp_path), "--concurrency", "4", "--avg-seq-len", "4096",
                          "--max-seq-len", "16384", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == {"layers": 30, "kv_heads": 3, "head_dim": 64, "dtype": "bfloat16"}
    assert out["bytes_per_token"]["full"] == 23040
    assert plan.run(parse("--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--max-seq-len", "131072")) == 0
    text = capsys.readouterr().out
    assert "320.0 KiB full" in text and "HBM:DRAM" in text


@pytest.mark.parametrize("argv, msg", [
    (("--layers", "2", "--kv-heads", "1", "--max-seq-len", "10"), "head_dim"),
    (("--layers", "2", "--kv-heads", "1", "--head-dim", "8"), "avg_seq_len"),
    (("--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--max-seq-len", "10", "--codec", "zip"), "codec"),
    (("--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--avg-seq-len", "20", "--max-seq-len", "10"),
     "avg_seq_len"),
])
def test_cli_bad_input(argv, msg, capsys):
    assert plan.run(parse(*argv)) == 2
    assert msg in capsys.readouterr().err
