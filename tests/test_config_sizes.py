"""Token sizes are whole blocks: a config resolves to exactly what was asked, or says why at construction."""
import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.store import KVStore


@pytest.mark.parametrize("kwargs, message", [
    (dict(device_tokens=102),
     "device_tokens must be a whole number of blocks (block_tokens=64, the default for dense attention): "
     "64 or 128; got 102"),
    (dict(device_tokens=102, attention="sparse"),
     "device_tokens must be a whole number of blocks (block_tokens=16, the default for sparse attention): "
     "96 or 112; got 102"),
    (dict(device_tokens=100, block_tokens=32),
     "device_tokens must be a whole number of blocks (block_tokens=32): 96 or 128; got 100"),
    (dict(budget_tokens=102, attention="sparse"),
     "budget_tokens must be a whole number of blocks (block_tokens=16, the default for sparse attention): "
     "96 or 112; got 102"),
    (dict(device_tokens=102, budget_tokens=102, attention="sparse"), "device_tokens must be a whole number of blocks"),
    (dict(budget_tokens=40, block_tokens=32),
     "budget_tokens must be a whole number of blocks (block_tokens=32): 32 or 64; got 40"),
    (dict(sink_tokens=4, attention="sparse"),
     "sink_tokens must be a whole number of blocks (block_tokens=16, the default for sparse attention): "
     "0 or 16; got 4"),
    (dict(window_tokens=40, attention="sparse", block_tokens=32),
     "window_tokens must be a whole number of blocks (block_tokens=32): 32 or 64; got 40"),
])
def test_a_size_that_is_not_whole_blocks_is_refused_with_the_nearest_values(kwargs, message):
    with pytest.raises(ValueError) as e:
        KVTierConfig(**kwargs)
    assert message in str(e.value)


def test_below_one_block_names_the_minimum():
    with pytest.raises(ValueError, match=r"device_tokens must be >= block_tokens \(64\); got 32"):
        KVTierConfig(device_tokens=32)


@pytest.mark.parametrize("kwargs", [
    dict(device_tokens=128),
    dict(device_tokens=112, attention="sparse"),
    dict(device_tokens=112, budget_tokens=96, sink_tokens=0, window_tokens=48, attention="sparse"),
    dict(device_tokens=192, budget_tokens=160, block_tokens=32, attention="sparse"),
    dict(device_tokens=48, attention="sparse"),
])
def test_a_valid_size_resolves_to_itself_in_the_config_and_the_store(kwargs):
    cfg = KVTierConfig(host_bytes=1 << 20, codec="fp16", **kwargs)
    res = cfg.to_dict(resolved=True)
    for name, v in kwargs.items():
        assert res[name] == v, name
    st = KVStore(cfg, num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float16, device="cpu")
    try:
        lay = st.layout
        bt = lay.block_tokens
        assert bt == res["block_tokens"]
        assert lay.device_blocks * bt == res["device_tokens"]
        assert lay.budget_tokens == res["budget_tokens"]
        assert lay.sink_blocks * bt == res["sink_tokens"]
        assert lay.window_blocks * bt == res["window_tokens"]
    finally:
        st.close()
