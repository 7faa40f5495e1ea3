import argparse
import json

import pytest

from kvtier import plan
from kvtier.commands import plan as plan_command


def parse(*argv):
    p = argparse.ArgumentParser()
    plan_command.add_arguments(p)
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
    assert out["config"]["device_tokens"] % 64 == 0


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
    assert plan_command.run(parse("--config", str(tmp_path), "--concurrency", "4", "--avg-seq-len", "4096",
                          "--max-seq-len", "16384", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == {"layers": 30, "kv_heads": 3, "head_dim": 64, "dtype": "bfloat16"}
    assert out["bytes_per_token"]["full"] == 23040
    assert plan_command.run(parse("--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--max-seq-len", "131072")) == 0
    text = capsys.readouterr().out
    assert "320.0 KiB full" in text and "HBM:DRAM" in text


@pytest.mark.parametrize("argv, msg", [
    (("--layers", "2", "--kv-heads", "1", "--max-seq-len", "10"), "head_dim"),
    (("--layers", "2", "--kv-heads", "1", "--head-dim", "8"), "avg_seq_len"),
    (("--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--avg-seq-len", "20", "--max-seq-len", "10"),
     "avg_seq_len"),
])
def test_cli_bad_input(argv, msg, capsys):
    assert plan_command.run(parse(*argv)) == 2
    assert msg in capsys.readouterr().err


def test_cli_unknown_codec_lists_the_codecs(capsys):
    with pytest.raises(SystemExit) as ei:
        parse("--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--max-seq-len", "10", "--codec", "zip")
    assert ei.value.code == 2 and "invalid choice: 'zip'" in capsys.readouterr().err


@pytest.mark.parametrize("workload", [
    dict(concurrency=1, avg_seq_len=1, max_seq_len=1, codec="int4"),  # the floors: one L2 record, two L3 segments
    dict(concurrency=2, avg_seq_len=1000, max_seq_len=3000, block_tokens=16, codec="int8"),
])
def test_printed_tier_sizes_are_what_a_store_of_the_config_allocates(tmp_path, capsys, workload):
    import torch

    from kvtier.config import KVTierConfig
    from kvtier.store import KVStore

    out = plan.make_plan(30, 3, 64, "float16", disk_path=str(tmp_path / "l3"), **workload)
    t = out["tiers"]
    with KVStore(KVTierConfig.from_dict(out["config"]), 30, 3, 64, dtype=torch.float16) as st:
        assert t["l1_hbm_bytes"] == st.l1.capacity_bytes == st.l1.storage.nbytes
        assert t["l2_dram_bytes"] == st.l2.capacity_bytes
        assert t["l3_ssd_bytes"] == st.l3.capacity_bytes
    assert t["l2_dram_bytes"] >= out["needed"]["l2_dram_bytes"] and t["l3_ssd_bytes"] >= out["needed"]["l3_ssd_bytes"]
    assert t["dram_to_hbm"] == round(t["l2_dram_bytes"] / t["l1_hbm_bytes"], 3)
    argv = ["--layers", "30", "--kv-heads", "3", "--head-dim", "64"]
    for k, v in workload.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    assert plan_command.run(parse(*argv)) == 0
    text = capsys.readouterr().out
    for line, key in (("L1 HBM", "l1_hbm_bytes"), ("L2 DRAM", "l2_dram_bytes"), ("L3 SSD", "l3_ssd_bytes")):
        assert f"{line:<10} {plan_command._fmt(t[key])} " in text
    assert "L2 DRAM    0 B" not in text
