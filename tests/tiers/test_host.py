"""HostTier specifics: ring order, wrap-around, batched spill, refusal without a next tier."""
from __future__ import annotations

import pytest
import torch

from kvtier.tiers import HostTier


class Collect:
    def __init__(self):
        self.batches: list[list[tuple[str, bytes]]] = []

    def __call__(self, batch):
        self.batches.append([(k, bytes(v)) for k, v in batch])  # copy: the views die on return


def test_ring_spills_oldest_first_in_batches_and_wraps():
    nxt = Collect()
    t = HostTier(8192, spill=nxt, spill_batch_bytes=2000)
    size = t.record_bytes("k00", 1000)  # 1024 with header and padding
    assert size == 1024  # 16-byte header + 3-byte key + 1000, padded to 64
    vals = {f"k{i:02d}": bytes([i]) * 1000 for i in range(20)}
    for k, v in vals.items():
        assert t.put(k, v)
    spilled = [k for b in nxt.batches for k, _ in b]
    assert spilled == [f"k{i:02d}" for i in range(len(spilled))]  # exactly oldest first
    assert all(len(b) == 2 for b in nxt.batches)  # 2 x 1000 bytes reach spill_batch_bytes
    assert all(v == vals[k] for b in nxt.batches for k, v in b)
    live = list(t.keys())
    assert live == [f"k{i:02d}" for i in range(len(spilled), 20)]
    assert all(t.get(k) == vals[k] for k in live)
    assert t.stats()["spilled_records"] == len(spilled) and t.used_bytes == len(live) * size
    offsets = [e[0] for e in t._log if e[2] is not None]
    assert min(offsets) == 0 and offsets != sorted(offsets)  # the live log wraps round the arena


def test_holes_are_reused_without_spilling():
    nxt = Collect()
    t = HostTier(4096, spill=nxt)
    for i in range(3):
        t.put(f"a{i}", b"x" * 1000)
    t.delete("a0")
    t.delete("a1")  # holes at the tail are reclaimed at once
    assert t.put("b", b"y" * 2000) and nxt.batches == []
    assert sorted(t.keys()) == ["a2", "b"]


def test_without_next_tier_full_ring_refuses_and_keeps_everything():
    t = HostTier(4096, spill=None)
    kept = {}
    i = 0
    while t.put(f"k{i}", bytes([i]) * 900):
        kept[f"k{i}"] = bytes([i]) * 900
        i += 1
    assert len(kept) == 4 and {k: t.get(k) for k in t.keys()} == kept
    assert t.stats()["spills"] == 0


def test_failing_spill_keeps_records_and_reports():
    def broken(batch):
        raise OSError("disk gone")

    t = HostTier(4096, spill=broken)
    for i in range(4):
        assert t.put(f"k{i}", b"z" * 900)
    assert t.put("new", b"n" * 900) is False
    assert sorted(t.keys()) == [f"k{i}" for i in range(4)] and t.get("new") is None
    s = t.stats()
    assert s["spill_errors"] == 1 and isinstance(t.last_spill_error, OSError)


def test_overwrite_keeps_latest_only():
    t = HostTier(4096)
    t.put("a", b"1" * 100)
    t.put("a", b"2" * 200)
    assert t.get("a") == b"2" * 200 and len(t) == 1
    assert t.used_bytes == t.record_bytes("a", 200)


def test_get_into_buffer_and_tensor():
    t = HostTier(1 << 20)
    payload = bytes(range(256)) * 1200  # above the torch-copy threshold too
    t.put("big", payload)
    t.put("small", b"abc")
    out = torch.zeros(len(payload) // 2, dtype=torch.float16)  # any dtype, viewed as bytes
    assert t.get_into("big", out) == len(payload)
    assert out.view(torch.uint8).numpy().tobytes() == payload
    buf = bytearray(10)
    assert t.get_into("small", buf) == 3 and bytes(buf[:3]) == b"abc"
    assert t.get_into("missing", buf) is None
    with pytest.raises(ValueError, match="out"):
        t.get_into("big", bytearray(10))
    with pytest.raises(ValueError, match="out"):
        t.get_into("small", b"read-only")


def test_tensor_put_any_dtype():
    t = HostTier(1 << 16)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    t.put("x", x)
    back = torch.frombuffer(bytearray(t.get("x")), dtype=torch.bfloat16).view(4, 8)
    assert torch.equal(back, x)


def test_checksum_mode_verifies():
    t = HostTier(8192, checksum=True)
    t.put("a", b"q" * 300)
    assert t.get("a") == b"q" * 300
    off = t._index["a"][0]
    t._np[off + 100] ^= 0xFF  # something scribbled over the arena
    with pytest.raises(AssertionError, match="checksum"):
        t.get("a")


def test_bad_constructor_args():
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostTier(100)
    with pytest.raises(ValueError, match="spill"):
        HostTier(8192, spill=42)
    with pytest.raises(ValueError, match="spill_batch_bytes"):
        HostTier(8192, spill_batch_bytes=0)
    with pytest.raises(ValueError, match="pin_memory"):
        HostTier(8192, pin_memory="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_arena_and_device_tensors():
    t = HostTier(1 << 20)
    assert t.arena.is_pinned()
    x = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    t.put("x", x)
    out = torch.empty_like(x)
    assert t.get_into("x", out) == x.numel() * 2
    assert torch.equal(out, x)


def test_without_next_tier_holes_behind_a_live_tail_are_reclaimed():
    t = HostTier(4096, spill=None)
    assert t.put("pinned", b"p" * 500)  # stays at the tail for the whole test
    for i in range(40):  # churn: every overwrite leaves a hole behind the pinned record
        assert t.put("hot", bytes([i]) * 1500), i
    assert t.get("pinned") == b"p" * 500 and t.get("hot") == bytes([39]) * 1500
    assert t.stats()["defragments"] >= 1


def test_failing_spill_overflows_up_to_its_bound_then_drains_once_spill_works():
    failing = {"on": True}
    nxt = Collect()

    def spill(batch):
        if failing["on"]:
            raise OSError(28, "No space left on device")
        nxt(batch)

    t = HostTier(4096, spill=spill, overflow_bytes=3 * 1024)
    vals = {f"k{i}": bytes([i]) * 1000 for i in range(8)}
    oks = [t.put(k, v) for k, v in vals.items()]
    assert oks == [True] * 7 + [False]  # 4 in the ring, 3 over it, then refused
    s = t.stats()
    assert s["overflow_records"] == 3 and s["overflow_used_bytes"] == 3 * 1024 and s["spill_errors"] > 0
    assert s["used_bytes"] == 7 * 1024 and len(t) == 7 and list(t.keys())[-3:] == ["k4", "k5", "k6"]
    assert all(t.get(k) == vals[k] for k in list(vals)[:7]) and t.value_size("k5") == 1000
    buf = bytearray(1000)
    assert t.get_into("k6", buf) == 1000 and bytes(buf) == vals["k6"]
    assert t.put("k5", b"new") and t.get("k5") == b"new"  # overwriting one in the overflow
    assert t.delete("k6") and not t.contains("k6") and t.stats()["overflow_records"] == 2
    failing["on"] = False
    assert t.put("k7", vals["k7"])  # the ring spills again, then the overflow goes too
    spilled = dict(kv for b in nxt.batches for kv in b)
    assert spilled["k4"] == vals["k4"] and spilled["k5"] == b"new" and "k6" not in spilled
    s = t.stats()
    assert s["overflow_records"] == 0 and s["overflow_used_bytes"] == 0 and s["overflow_peak_bytes"] == 3 * 1024
    assert t.get("k7") == vals["k7"] and not t.contains("k4")


def test_overflow_bytes_must_be_a_non_negative_int():
    for bad in (-1, 1.5, "1"):
        with pytest.raises(ValueError, match="overflow_bytes"):
            HostTier(4096, overflow_bytes=bad)
