import json

import pytest

from kvtier.config import KVTierConfig


def test_contract_names_work():
    cfg = KVTierConfig(block_tokens=64, device_tokens=512, host_bytes=256 << 20, disk_path="kvtier-cache",
                       codec="int4", order="compress-then-tier", policy="h2o", attention="sparse",
                       budget_tokens=512)
    assert cfg.host_codec == "int4" and cfg.disk_codec == "int4"
    assert cfg.sink_tokens + cfg.window_tokens + cfg.block_tokens <= cfg.budget_tokens
    json.dumps(cfg.to_dict())
    assert KVTierConfig.from_dict(cfg.to_dict()) == cfg


def test_order_fills_per_tier_codecs():
    c = KVTierConfig(codec="int8", order="tier-then-compress")
    assert (c.host_codec, c.disk_codec) == ("fp16", "int8")
    c = KVTierConfig(codec="int8", order="tier-then-compress", dtype="bfloat16")
    assert c.host_codec == "bf16"
    c = KVTierConfig(codec="int8", host_codec="int4")
    assert (c.host_codec, c.disk_codec) == ("int4", "int8")


def test_frozen():
    c = KVTierConfig()
    with pytest.raises(Exception):
        c.block_tokens = 3


@pytest.mark.parametrize("kwargs, field", [
    (dict(policy="fifo"), "policy"),
    (dict(codec="int3"), "codec"),
    (dict(host_codec="zip"), "host_codec"),
    (dict(order="both"), "order"),
    (dict(attention="flash"), "attention"),
    (dict(device_tokens=32, block_tokens=64), "device_tokens"),
    (dict(device_tokens=256, budget_tokens=512), "budget_tokens"),
    (dict(device_tokens=512, budget_tokens=128, sink_tokens=64, window_tokens=64), "budget_tokens"),
    (dict(block_tokens=0), "block_tokens"),
    (dict(low_watermark=0.95, high_watermark=0.9), "low_watermark"),
    (dict(high_watermark=1.5), "high_watermark"),
    (dict(durability="sometimes"), "durability"),
    (dict(byte_stage_min_saving=1.5), "byte_stage_min_saving"),
    (dict(byte_stage="gzip"), "byte_stage"),
    (dict(byte_stage_l2="yes"), "byte_stage_l2"),
    (dict(key_axis="row"), "key_axis"),
    (dict(dtype="float8"), "dtype"),
    (dict(disk_bytes=1 << 20, disk_segment_bytes=4 << 20), "disk_bytes"),
    (dict(prefetch="yes"), "prefetch"),
    (dict(prefetch=1), "prefetch"),
])
def test_bad_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KVTierConfig(**kwargs)


def test_from_toml(tmp_path):
    p = tmp_path / "kv.toml"
    p.write_text('[kvtier]\nblock_tokens = 32\nhot_tokens = 256\ncodec = "int8"\npolicy = "lru"\n'
                 'order = "tier-then-compress"\nprefetch = false\n')
    c = KVTierConfig.from_toml(p)
    assert (c.block_tokens, c.device_tokens, c.codec, c.policy, c.prefetch) == (32, 256, "int8", "lru", False)
    assert c.host_codec == "fp16"
    p.write_text('block_tokens = 32\nhot_tokenz = 256\n')
    with pytest.raises(ValueError, match="hot_tokenz"):
        KVTierConfig.from_toml(p)


def test_prefetch_auto_is_off_on_a_cpu_store_and_can_be_forced():
    from kvtier.store import KVStore

    assert KVTierConfig().prefetch == "auto"
    assert KVTierConfig.from_dict(KVTierConfig(prefetch="auto").to_dict()).prefetch == "auto"
    for pf, on in (("auto", False), (True, True), (False, False)):
        st = KVStore(KVTierConfig(block_tokens=4, device_tokens=16, prefetch=pf), num_layers=1, kv_heads=1,
                     head_dim=4, device="cpu")
        assert st.prefetch is on and st.prefetcher.enabled is on
        pf = json.loads(json.dumps(st.stats()))["prefetch"]
        assert pf["enabled"] is on
        if not on:
            assert pf["coverage"] is None and pf["precision"] is None
        st.close()
