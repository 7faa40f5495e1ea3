"""The CLI's `plan` and `generate`: plans KVTierConfig accepts, in exact integers, the seed's
LLaMA-2-70B table, and bad input as a sentence with exit code 2 before any model loads."""
import json

import pytest
import torch

from kvtier import plan
from kvtier.commands.cli import main
from kvtier.config import KVTierConfig
from kvtier.store.sizing import check_model

GIB = 1 << 30


def run_plan(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _ints(obj, path=""):
    """Every byte count of a plan (keys naming bytes or sizes) is an int, never a float."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _ints(v, f"{path}.{k}")
    elif "bytes" in path or "sequence" in path or path.endswith((".avg", ".max", "_full", "_codec")):
        if not path.endswith(("codec_ratio", "dram_to_hbm", "ratio_in_range", "bytes_per_token.codec",
                              "digest_bytes_per_token", "sparse.share")):
            assert type(obj) is int, f"{path} = {obj!r}"


def test_sizing_table_for_llama2_70b_as_the_seed_counts_it(capsys):
    # 80 layers, hidden 8192, fp16, one KV head per query head (the seed's arithmetic)
    p = run_plan(capsys, "--layers", "80", "--hidden-size", "8192", "--heads", "64", "--dtype", "float16",
                 "--concurrency", "10", "--avg-seq-len", "32768", "--max-seq-len", "131072")
    t = p["sizing_table"]
    assert p["bytes_per_token"]["full"] == 2 * 80 * 8192 * 2  # 2.5 MiB
    assert (t["4096"]["sequence"], t["32768"]["sequence"], t["131072"]["sequence"]) == (10 * GIB, 80 * GIB, 320 * GIB)
    assert t["131072"]["all_sequences"] == 3200 * GIB  # 10 x 128k: the seed's ~3.2 TB
    assert p["gqa"]["reduction"] == 1
    tiers = p["tiers"]
    assert tiers["ratio_in_range"] and tiers["l1_hbm_bytes"] < tiers["l2_dram_bytes"] < tiers["l3_ssd_bytes"]
    _ints(p)
    check_model(KVTierConfig.from_dict(p["config"]), 80, 64, 128, torch.float16, machine=False)


def test_sizing_table_with_the_gqa_correction(capsys):
    p = run_plan(capsys, "--layers", "80", "--hidden-size", "8192", "--heads", "64", "--kv-heads", "8",
                 "--concurrency", "10", "--max-seq-len", "131072")
    assert p["gqa"] == {"heads": 64, "kv_heads": 8, "mha_bytes_per_token": 2 * 80 * 8192 * 2, "reduction": 8}
    assert p["sizing_table"]["131072"]["sequence"] == 40 * GIB and p["sizing_table"]["131072"]["all_sequences"] == 400 * GIB
    assert main(["plan", "--layers", "80", "--hidden-size", "8192", "--heads", "64", "--kv-heads", "8",
                 "--max-seq-len", "131072"]) == 0
    text = capsys.readouterr().out
    assert "GQA        8 kv heads for 64 query heads: KV is 1/8" in text
    assert "128k: 40.0 GiB" in text


@pytest.mark.parametrize("argv", [
    ("--max-seq-len", "1"),                                   # everything in L1: L2 would be 0 bytes
    ("--max-seq-len", "8192", "--hbm-bytes", "40G"),          # HBM holds it all
    ("--max-seq-len", "100000000", "--concurrency", "100"),   # huge: exact integers
    ("--avg-seq-len", "1000", "--max-seq-len", "4096", "--codec", "fp32", "--dtype", "float32"),
    ("--avg-seq-len", "1000", "--max-seq-len", "4096", "--codec", "bf16", "--dtype", "bfloat16"),
    ("--max-seq-len", "4096", "--hbm-bytes", "1.5G", "--concurrency", "3"),
])
def test_every_plan_is_a_config_kvtier_accepts_in_integers(capsys, argv):
    p = run_plan(capsys, "--layers", "30", "--kv-heads", "3", "--head-dim", "64", *argv)
    _ints(p)
    cfg = KVTierConfig.from_dict(p["config"])
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[p["model"]["dtype"]]
    check_model(cfg, 30, 3, 64, dtype, machine=False)
    assert cfg.host_bytes >= p["tiers"]["l2_dram_bytes"] and cfg.disk_bytes >= p["tiers"]["l3_ssd_bytes"]
    assert cfg.disk_bytes % cfg.disk_segment_bytes == 0
    assert main(["plan", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", *argv]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("config")][0]
    printed = eval(line.split(None, 1)[1], {"KVTierConfig": KVTierConfig})  # the printed config builds
    assert printed == cfg


def test_exact_integers_at_sizes_where_floats_drift():
    p = plan.make_plan(30, 3, 64, "float16", 100, 10 ** 8, 10 ** 8, "int4")
    per_block = p["bytes_per_token"]["codec_per_block"]
    assert p["needed"]["l3_ssd_bytes"] == -(-100 * 10 ** 8 * per_block // 64)  # ceil, exactly
    assert p["tiers"]["l3_ssd_bytes"] == p["config"]["disk_bytes"] >= p["needed"]["l3_ssd_bytes"]


@pytest.mark.parametrize("content, msg", [
    ("[1, 2]", "must hold a JSON object"),
    ("{", "is not JSON"),
    ('{"num_hidden_layers": "many"}', "lacks num_hidden_layers"),
])
def test_plan_config_errors_are_sentences(tmp_path, capsys, content, msg):
    p = tmp_path / "config.json"
    p.write_text(content)
    assert main(["plan", "--config", str(p), "--max-seq-len", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier plan: error: ") and msg in err and "Traceback" not in err
    assert main(["plan", "--config", str(tmp_path / "missing.json"), "--max-seq-len", "10"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_plan_beyond_what_a_config_can_hold_is_a_sentence(capsys):
    assert main(["plan", "--layers", "30", "--kv-heads", "3", "--head-dim", "64",
                 "--max-seq-len", "1000000000000", "--concurrency", "1000"]) == 2
    assert "lower --max-seq-len" in capsys.readouterr().err


@pytest.fixture
def no_model(monkeypatch):
    """generate must refuse bad input before it loads a model."""
    import kvtier.models as m

    def refuse(*a, **kw):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(m, "load_model", refuse)


@pytest.mark.parametrize("argv, msg", [
    (("--config", "/nonexistent/kv.toml"), "config file '/nonexistent/kv.toml' does not exist"),
    (("--codec", "zip"), "invalid choice: 'zip'"),
    (("--device-tokens", "3"), "device_tokens must be >= block_tokens"),
    (("--max-new-tokens", "0"), "--max-new-tokens must be >= 1"),
])
def test_generate_bad_input_is_a_sentence_before_the_model_loads(no_model, capsys, argv, msg):
    with pytest.raises(SystemExit) as ei:
        main(["generate", "--prompt", "hi", *argv])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "kvtier generate: error: " in err and msg in err


def test_generate_config_file_fields_are_re_derived_with_the_flags(tmp_path):
    import argparse

    from kvtier.commands import generate as chat

    toml = tmp_path / "kv.toml"
    toml.write_text('codec = "int4"\nhot_tokens = 256\n')
    p = argparse.ArgumentParser()
    chat.add_arguments(p)
    cfg = chat._config(p.parse_args(["--config", str(toml), "--codec", "int8", "--device-tokens", "128"]), "/scratch")
    assert (cfg.host_codec, cfg.disk_codec, cfg.budget_tokens) == ("int8", "int8", 128)
    assert cfg.disk_path == "/scratch"  # neither the file nor a flag names L3: the per-run directory
    toml.write_text('disk_path = "/kept"\n')
    assert chat._config(p.parse_args(["--config", str(toml)]), "/scratch").disk_path == "/kept"
    assert chat._config(p.parse_args(["--config", str(toml), "--disk-path", ""]), "/scratch").disk_path is None


def test_python_dash_m_kvtier_is_the_kvtier_command():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvtier", "plan", "--layers", "30", "--kv-heads", "3",
                        "--head-dim", "64", "--avg-seq-len", "4096", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes_per_token"]["full"] == 2 * 30 * 3 * 64 * 2
    r = subprocess.run([sys.executable, "-m", "kvtier", "plan", "--layers", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "error" in r.stderr
