"""KVTierConfig: every field checked at construction, derived fields derived again on every
rebuild, and the sizes that need the model's shape checked before the store allocates."""
import dataclasses
import json
import math

import pytest
import torch

from kvtier.config import DEFAULT_DIGEST_TOKENS, DERIVED_FIELDS, KVTierConfig
from kvtier.store.sizing import check_model

# SmolLM2-135M's KV shape: 30 layers, 3 kv heads, head_dim 64 (float32 as load_model() gives)
SHAPE = dict(num_layers=30, kv_heads=3, head_dim=64)


def store(cfg, dtype=torch.float32):
    from kvtier.store import KVStore

    return KVStore(cfg, **SHAPE, dtype=dtype, device="cpu")


# -- derived fields ---------------------------------------------------------------------------

def test_replace_derives_host_and_disk_codec_again():
    cfg = KVTierConfig()
    assert (cfg.host_codec, cfg.disk_codec) == ("int4", "int4")
    r = dataclasses.replace(cfg, codec="int8")
    assert (r.host_codec, r.disk_codec) == ("int8", "int8")
    t = dataclasses.replace(cfg, order="tier-then-compress")
    assert (t.host_codec, t.disk_codec) == ("fp16", "int4")
    assert dataclasses.replace(t, dtype="bfloat16").host_codec == "bf16"
    assert dataclasses.replace(t, dtype="float32").host_codec == "fp32"


def test_a_value_the_user_set_is_kept_even_if_equal_to_the_derived_one():
    cfg = KVTierConfig()  # host_codec derived: int4
    r = dataclasses.replace(cfg, codec="int8", host_codec="int4")  # set by the user: kept
    assert (r.host_codec, r.disk_codec) == ("int4", "int8")
    assert not r.is_derived("host_codec") and r.is_derived("disk_codec")
    assert dataclasses.replace(r, codec="int2").host_codec == "int4"


def test_replace_of_block_tokens_and_hot_tokens_derives_digest_and_budget():
    cfg = KVTierConfig(attention="sparse")
    assert (cfg.block_tokens, cfg.digest_tokens, cfg.digest_dtype) == (16, DEFAULT_DIGEST_TOKENS, "int4")  # the sparse defaults
    r = dataclasses.replace(cfg, block_tokens=9, device_tokens=9 * 56)  # sizes are whole blocks
    assert r.digest_tokens == math.gcd(9, DEFAULT_DIGEST_TOKENS)  # a divisor of block_tokens
    assert dataclasses.replace(r, select_score="quest").digest_tokens == 9  # quest's follows block_tokens
    assert dataclasses.replace(cfg, select_score="quest").digest_tokens == 16
    # the block size follows the attention mode unless set
    assert KVTierConfig().block_tokens == 64 and dataclasses.replace(KVTierConfig(), attention="sparse").block_tokens == 16
    assert dataclasses.replace(KVTierConfig(block_tokens=32), attention="sparse").block_tokens == 32
    r = dataclasses.replace(cfg, device_tokens=128)
    assert r.budget_tokens == 128
    assert r.sink_tokens + r.window_tokens + r.block_tokens <= r.budget_tokens
    # a budget the user set is checked against the new device_tokens, not silently dropped
    with pytest.raises(ValueError, match="budget_tokens must be <= device_tokens"):
        dataclasses.replace(KVTierConfig(budget_tokens=512), device_tokens=128)


def test_to_dict_gives_what_the_user_set_and_from_dict_derives_the_rest():
    cfg = KVTierConfig(codec="int4", device_tokens=256)
    d = cfg.to_dict()
    assert all(d[name] is None for name in DERIVED_FIELDS)
    assert d["codec"] == "int4" and d["device_tokens"] == 256
    assert KVTierConfig.from_dict(d) == cfg
    changed = KVTierConfig.from_dict(d | {"codec": "int8", "block_tokens": 16, "device_tokens": 64})
    assert (changed.host_codec, changed.disk_codec, changed.digest_tokens, changed.budget_tokens) == \
        ("int8", "int8", DEFAULT_DIGEST_TOKENS, 64)
    # resolved: the values in effect, plain JSON types
    r = json.loads(json.dumps(cfg.to_dict(resolved=True)))
    assert r["host_codec"] == "int4" and r["budget_tokens"] == 256 and type(r["budget_tokens"]) is int


def test_from_dict_and_from_toml_refuse_what_is_not_a_table(tmp_path):
    with pytest.raises(ValueError, match=r"a dict\); got a list"):
        KVTierConfig.from_dict([1, 2])
    with pytest.raises(ValueError, match="does not exist"):
        KVTierConfig.from_toml(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("codec = ")
    with pytest.raises(ValueError, match="not valid TOML"):
        KVTierConfig.from_toml(bad)


# -- every field at construction ----------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(write_through="no"), "write_through must be True or False"),
    (dict(write_through=1), "write_through must be True or False"),
    (dict(byte_stage_l2=0), "byte_stage_l2 must be True or False"),
    (dict(group_size=16), "group_size must be one of 32, 64, 128"),
    (dict(group_size=True), "group_size must be one of"),
    (dict(group_size=64.0), "group_size must be one of 32, 64, 128; got 64.0"),
    (dict(host_bytes=1024), r"host_bytes must be an int >= 4096 .*one block of the model"),
    (dict(host_bytes=10 ** 20), "host_bytes must be an int >= 4096 and <= "),
    (dict(host_bytes=4.0e9), "host_bytes must be an int"),
    (dict(device_tokens=10 ** 12), "device_tokens must be an int >= 1 and <= "),
    (dict(device_bytes=10 ** 20), "device_bytes must be an int"),
    (dict(max_sequences=10 ** 9), "max_sequences must be an int"),
    (dict(disk_bytes=10 ** 20), "disk_bytes must be an int"),
    (dict(disk_segment_bytes=1 << 33, disk_bytes=1 << 40), r"disk_segment_bytes must be an int >= 4096 and <= "),
    (dict(disk_path=""), "disk_path must be a non-empty path"),
    (dict(disk_path="a\x00b"), "disk_path must be a non-empty path"),
    (dict(disk_path=3), "disk_path must be a non-empty path"),
    (dict(codec="fp8"), "codec must be one of"),
    (dict(remote_url="redis://127.0.0.1:6379/0?timeout=abc"), "remote_url .*Redis client.*timeout"),
    (dict(remote_url=" redis://127.0.0.1:6379/0"), "remote_url must be a URL the Redis client accepts"),
    (dict(remote_url="redis://127.0.0.1:6379/99999"), r"remote_url must name a db in \[0, 15\].*99999"),
    (dict(remote_url="unix:///tmp/r.sock?db=abc"), "remote_url"),
    (dict(remote_url="http://x"), "remote_url must be a Redis URL"),
    (dict(budget_tokens=10 ** 12), "budget_tokens must be an int"),
    (dict(sink_tokens=-1), "sink_tokens must be an int >= 0"),
    (dict(digest_tokens=128), "digest_tokens must be an int >= 1 and <= 64"),
    (dict(evict_batch_blocks=0), "evict_batch_blocks must be an int >= 1"),
])
def test_bad_value_names_the_field_and_what_is_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVTierConfig(**kwargs)


def test_good_remote_urls_pass():
    for url in ("redis://127.0.0.1:6379/0", "redis://h", "rediss://u:p@h:6380/15",
                "unix:///tmp/r.sock?db=3", "redis://h:1/0?socket_timeout=0.5"):
        assert KVTierConfig(remote_url=url).remote_url == url


def test_fp32_codec_is_accepted():
    assert KVTierConfig(codec="fp32").disk_codec == "fp32"


# -- sizes against the model's shape, before anything is allocated -----------------------------------

def test_host_bytes_below_one_block_is_refused_at_attach_in_bytes():
    cfg = KVTierConfig(host_bytes=4096, codec="int4")
    with pytest.raises(ValueError, match=r"host_bytes must hold at least one block: >= [\d,]+ bytes for this model"):
        store(cfg)


def test_host_bytes_of_exactly_one_block_builds_and_serves(tmp_path):
    import re

    base = dict(codec="fp32", block_tokens=16, device_tokens=32, disk_path=str(tmp_path / "l3"),
                disk_segment_bytes=1 << 20, disk_bytes=8 << 20)
    with pytest.raises(ValueError) as ei:
        store(KVTierConfig(host_bytes=4096, **base))
    need = int(re.search(r">= ([\d,]+) bytes", str(ei.value)).group(1).replace(",", ""))
    st = store(KVTierConfig(host_bytes=need, **base))  # L2 holds one block and spills the rest to L3
    try:
        seq = st.add_sequence()
        k = torch.randn(3, 40, 64)  # [kv_heads, tokens, head_dim]: 2 sealed blocks, 1 evicted to L2
        for layer in range(SHAPE["num_layers"]):
            st.append(seq, layer, k, -k)
        st.end_step()
        gk, gv = st.gather(seq, 0)
        assert torch.equal(gk, k) and torch.equal(gv, -k)  # fp32 is lossless
    finally:
        st.close()


def test_l1_beyond_the_device_is_refused_before_allocation():
    from kvtier.configcheck import physical_memory

    ram = physical_memory()
    tokens = 1 << 24  # 16 M tokens per sequence: terabytes of L1 for this model
    assert ram is not None and tokens * 30 * 2 * 3 * 64 * 4 > ram
    with pytest.raises(ValueError, match=r"device_tokens x max_sequences must fit the L1 device .*at most about device_tokens="):
        store(KVTierConfig(device_tokens=tokens))


def test_host_bytes_beyond_this_machine_is_refused_at_attach_and_accepted_for_a_plan():
    from kvtier.configcheck import physical_memory

    cfg = KVTierConfig(host_bytes=physical_memory() + (1 << 30))  # a plan for a bigger machine
    check_model(cfg, **SHAPE, dtype=torch.float32, machine=False)
    with pytest.raises(ValueError, match=r"host_bytes must be at most this machine's memory \([\d,]+ bytes\)"):
        store(cfg)


def test_disk_too_small_for_a_record_names_disk_segment_bytes_and_disk_bytes(tmp_path):
    with pytest.raises(ValueError, match=r"disk_segment_bytes must hold at least one block: >= [\d,]+ bytes"):
        store(KVTierConfig(disk_path=str(tmp_path / "a"), codec="fp32", disk_segment_bytes=8192,
                           disk_bytes=1 << 20))
    with pytest.raises(ValueError, match=r"disk_bytes must hold at least two segments"):
        store(KVTierConfig(disk_path=str(tmp_path / "b"), disk_segment_bytes=1 << 20,
                           disk_bytes=(1 << 20) + 4096))
    with pytest.raises(ValueError, match=r"disk_bytes must hold two L3 segments of at least one block each: >= [\d,]+ bytes"):
        store(KVTierConfig(disk_path=str(tmp_path / "c"), codec="fp32", disk_bytes=16384))
    assert not any((tmp_path / d).exists() for d in "abc")  # nothing was created


def test_segment_size_follows_a_small_disk_bytes_unless_set():
    assert KVTierConfig().disk_segment_bytes == 64 << 20
    small = KVTierConfig(disk_bytes=64 << 20)
    assert small.disk_segment_bytes == 32 << 20 and small.is_derived("disk_segment_bytes")
    assert dataclasses.replace(small, disk_bytes=1 << 30).disk_segment_bytes == 64 << 20
    assert KVTierConfig(disk_bytes=64 << 20, disk_segment_bytes=8 << 20).disk_segment_bytes == 8 << 20


def test_derived_values_survive_pickle_and_deepcopy():
    import copy
    import pickle

    cfg = KVTierConfig(attention="sparse")
    for c in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert c == cfg and c.is_derived("host_codec") and c.is_derived("budget_tokens")
        assert dataclasses.replace(c, codec="int8").host_codec == "int8"


def test_default_split_leaves_small_sparse_budgets_room_to_select():
    # 48 tokens of 16-token blocks: sink, one block chosen by query, the open block
    cfg = KVTierConfig(attention="sparse", device_tokens=48)
    assert (cfg.sink_tokens, cfg.window_tokens) == (16, 0)
    # larger budgets keep the two-block window
    cfg = KVTierConfig(attention="sparse", device_tokens=256)
    assert (cfg.sink_tokens, cfg.window_tokens) == (16, 32)
    assert KVTierConfig(attention="sparse", device_tokens=64).window_tokens == 16
