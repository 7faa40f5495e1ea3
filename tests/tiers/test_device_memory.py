"""L1 on a CPU device commits memory as slots are written, not the whole budget at attach."""
import torch

from kvtier.config import KVTierConfig
from kvtier.tiers import DeviceTier


def _rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_large_l1_budget_costs_what_a_short_chat_writes():
    from kvtier.store import KVStore

    before = _rss()
    # SmolLM2's shape in float32, 4 sequences x 32k tokens: ~6 GiB of L1 budget
    st = KVStore(KVTierConfig(device_tokens=32768), num_layers=30, kv_heads=3, head_dim=64,
                 dtype=torch.float32, device="cpu")
    try:
        assert st.l1.capacity_bytes > 5 << 30
        built = _rss()
        seq = st.add_sequence()
        k = torch.randn(3, 100, 64)  # [kv_heads, tokens, head_dim]
        for layer in range(30):
            st.append(seq, layer, k, -k)
        st.end_step()
        gk, gv = st.gather(seq, 29)
        assert torch.equal(gk, k) and torch.equal(gv, -k)
        used = _rss()
        assert built - before < 64 << 20, f"RSS grew {(built - before) >> 20} MiB at build"
        assert used - before < 128 << 20, f"RSS grew {(used - before) >> 20} MiB for 100 tokens"
    finally:
        st.close()


def test_lazily_committed_pool_reads_zeros_and_keeps_what_is_written():
    shape = (2, 3, 16, 64)  # [2, kv_heads, block_tokens, head_dim]
    t = DeviceTier(shape, 512, dtype=torch.float32, slot_axis=2, placed_slots=256)  # 12 MiB: lazy
    assert t.storage.shape == (2, 3, 512, 16, 64) and not t.storage.any()
    x = torch.randn(shape)
    assert t.put_at("a", 7, x) and t.put("b", x * 2)
    assert torch.equal(t.get_tensor("a"), x) and torch.equal(t.get_tensor("b"), x * 2)
    assert not t.pool[8].any()
    t.close()
