import argparse
import dataclasses
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


def test_role_codecs_k4v2_sized_as_the_store_encodes_and_frames_them(tmp_path, capsys):
    import torch

    from kvtier.config import KVTierConfig
    from kvtier.store import KVStore
    from kvtier.store.sizing import block_record_bytes

    shape = (4, 2, 64)  # layers, kv heads, head_dim
    work = dict(concurrency=1, avg_seq_len=1024, max_seq_len=1024, block_tokens=16, disk_path=str(tmp_path / "l3"))
    by = {c: plan.make_plan(*shape, "float16", codec=c, **work) for c in ("int2", "int4")}
    k4v2 = plan.make_plan(*shape, "float16", codec="int4", key_codec="int4", value_codec="int2", **work)
    per_block = {c: p["bytes_per_token"]["codec_per_block"] for c, p in by.items()}
    got = k4v2["bytes_per_token"]["codec_per_block"]
    # each role in its own codec: int4 keys as int4's half, int2 values as int2's half. All-int2 is
    # not below K4V2 here: int2 keys keep int2_key_outliers (8) channels exact per block, which
    # at these shapes outweighs the 2 bits saved on the rest, so only the values' half shrinks
    assert got < per_block["int4"] and got <= per_block["int2"]
    key = {c: p["roles"]["key"]["bytes_per_block"] for c, p in by.items()}
    assert got - per_block["int2"] == key["int4"] - key["int2"]
    assert k4v2["roles"] == {"key": by["int4"]["roles"]["key"], "value": by["int2"]["roles"]["value"]}
    assert (k4v2["roles"]["key"]["codec"], k4v2["roles"]["value"]["codec"]) == ("int4", "int2")
    assert got == sum(r["bytes_per_block"] for r in k4v2["roles"].values())
    cfg = KVTierConfig.from_dict(k4v2["config"])
    assert (cfg.key_codec, cfg.value_codec) == ("int4", "int2")
    # the framed records: what the store's own sizing says a block of this config takes
    own = KVTierConfig(block_tokens=16, device_tokens=16, codec="int4", key_codec="int4", value_codec="int2")
    assert k4v2["record_bytes"] == dict(zip(("l2", "l3"), block_record_bytes(own, 4, 2, 64, torch.float16)))
    assert k4v2["record_bytes"]["l2"] < by["int4"]["record_bytes"]["l2"]
    # a store of the printed config encodes each block spilled to L2 in exactly those bytes
    with KVStore(cfg, 4, 2, 64, dtype=torch.float16) as st:
        seq = st.add_sequence()
        n = cfg.device_tokens + 8 * 16
        for layer in range(4):
            st.append(seq, layer, torch.randn(2, n, 64).half(), torch.randn(2, n, 64).half())
        st.flush()
        c = st.counters.snapshot()
        blocks = c["raw_l2"] // (2 * 2 * 16 * 64 * 2)  # raw bytes of one block of one layer, K and V
        assert blocks >= 8 and c["enc_l2"] == blocks * got // 4
    # the CLI: the flags, the JSON field, the roles line
    argv = ["--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--max-seq-len", "1024", "--block-tokens", "16",
            "--key-codec", "int4", "--value-codec", "int2"]
    assert plan_command.run(parse(*argv, "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["roles"]["value"]["codec"] == "int2" and out["config"]["value_codec"] == "int2"
    assert out["sparse"]["config"]["value_codec"] == "int2"
    assert plan_command.run(parse(*argv)) == 0
    text = capsys.readouterr().out
    assert "as K int4 / V int2" in text and "roles      keys int4" in text and "value_codec='int2'" in text


@pytest.mark.parametrize("field, value", [("key_codec", "int3"), ("value_codec", "fp16")])
def test_bad_role_codec_names_the_field_and_the_choices(field, value, capsys):
    with pytest.raises(ValueError, match=rf"{field} must be one of fp32, int8, int4, int2, .*got '{value}'"):
        plan.make_plan(4, 2, 64, "float16", 1, 64, 64, "int4", **{field: value})
    with pytest.raises(SystemExit) as ei:
        parse("--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--max-seq-len", "10",
              f"--{field.replace('_', '-')}", value)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and f"--{field.replace('_', '-')}: invalid choice: '{value}'" in err and "int8" in err


@pytest.mark.parametrize("alt", [False, True])
@pytest.mark.parametrize("tokens", [40 * 16, 40 * 16 + 1, 17 * 16 + 5])
def test_sparse_digest_bytes_are_what_a_store_allocates(tokens, alt):
    # every sequence at max length: the plan's digest rows (used and held, the table's room
    # included) against a real store of the printed sparse config, and of its same-bytes
    # alternative with pair means (alt)
    import torch

    from kvtier.config import KVTierConfig
    from kvtier.store import KVStore

    layers, kvh, hd, seqs = 2, 2, 64, 2
    p = plan.make_plan(layers, kvh, hd, "bfloat16", seqs, tokens, tokens, "int4")
    sp = p["sparse"]
    if alt:
        full = sp
        sp = dict(sp["pairs_same_l1"], l1_digest_used_bytes=None)
        assert sp["config"]["digest_tokens"] == 2 and sp["device_tokens"] % 16 == 0
        # it fills the default's L1 bytes with KV where the default keeps per-token key rows:
        # no larger than the default's, one more block would not fit
        assert full["device_tokens"] <= sp["device_tokens"] and sp["l1_bytes"] <= full["l1_bytes"]
    fields = {k: v for k, v in sp["config"].items() if k != "preset"}
    fields.update(host_bytes=64 << 20, disk_path=None)
    cfg = KVTierConfig.preset("long-context", **fields)
    with KVStore(cfg, layers, kvh, hd, dtype=torch.bfloat16) as st:
        for _ in range(seqs):
            s = st.add_sequence()
            for layer in range(layers):
                kv = torch.randn(kvh, tokens, hd).to(torch.bfloat16)
                st.append(s, layer, kv, kv)
        stats = st.stats()
        assert sp["l1_digest_bytes"] == stats["digest_reserved_bytes"] > 0
        assert sp["l1_digest_used_bytes"] in (None, stats["digest_bytes"])
        assert sp["l1_kv_bytes"] == st.l1.capacity_bytes
    assert sp["l1_bytes"] == sp["l1_kv_bytes"] + sp["l1_digest_bytes"]
    if alt:
        # one more block (unless the budget already holds the whole sequence) and a real store's
        # pool no longer fits beside the digests
        if sp["device_tokens"] < tokens // 16 * 16:
            more = dataclasses.replace(cfg, device_tokens=sp["device_tokens"] + 16)
            with KVStore(more, layers, kvh, hd, dtype=torch.bfloat16) as st:
                assert st.l1.capacity_bytes + sp["l1_digest_bytes"] > full["l1_bytes"]
        return
    # int4 key rows per channel (half a byte a channel, a float16 scale and zero per channel and
    # block) per digest_tokens, an int8 value mean + f32 scale per value_digest_tokens tokens
    assert cfg.digest_dtype == "int4"
    assert sp["digest_bytes_per_token"] == layers * kvh * (
        hd / 2 / cfg.digest_tokens + 4 * hd / cfg.block_tokens + (hd + 4) / cfg.value_digest_tokens)
