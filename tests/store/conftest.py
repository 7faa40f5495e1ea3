import random

import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.store import KVStore
from kvtier.store.store import CONTENT_KEY


class Ref:
    """Plain reference of everything appended: (seq, layer) -> list of (k, v) chunks."""

    def __init__(self):
        self.chunks: dict[tuple[int, int], list] = {}

    def add(self, seq, layer, k, v):
        self.chunks.setdefault((seq, layer), []).append((k.clone(), v.clone()))

    def kv(self, seq, layer):
        ch = self.chunks[(seq, layer)]
        return torch.cat([c[0] for c in ch], 1), torch.cat([c[1] for c in ch], 1)


def make_store(tmp_path=None, num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float16, device="cpu",
               fingerprint="", **kw):
    base = dict(block_tokens=4, hot_tokens=16, host_bytes=8192, codec="fp16", policy="lru",
                max_sequences=4)
    if tmp_path is not None:
        base.update(disk_path=str(tmp_path / "l3"), disk_segment_bytes=1 << 16, disk_bytes=64 << 20)
    base.update(kw)
    return KVStore(KVTierConfig(**base), num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim,
                   dtype=dtype, device=device, fingerprint=fingerprint)


def check_invariants(store: KVStore) -> None:
    """After flush(): one consistent picture of every block across the tiers."""
    store.flush()
    l1_keys, l2_keys, l3_keys = set(), set(), set()
    for seq in store.sequences():
        for t in store._tables[seq]:
            assert t.pending == 0
            assert t.resident == sum(e.slot is not None for e in t.entries) <= store.hot_blocks
            assert t.slotted == {e.idx: e for e in t.entries if e.slot is not None}
            assert not t.entries or t.entries[-1].slot is not None, "open block left L1"
            # region: every resident block in its table's own slots, at[] the inverse of slot
            assert len(t.at) == t.cap == store.hot_blocks
            assert {id(e): e.slot - t.base for e in t.entries if e.slot is not None} == \
                {id(e): p for p, e in enumerate(t.at) if e is not None}
            if t.entries and t.open_view is not None:
                assert t.open_view.data_ptr() == store.l1.pool[t.entries[-1].slot].data_ptr(), \
                    "append views point away from the open block"
            for e in t.entries:
                assert not e.pending and e.home != "none", f"block lost: {e}"
                if e.slot is not None:
                    l1_keys.add(e.key)
                    assert store.l1.slot_of(e.key) == e.slot
                assert e in e.rec.entries and store._recs.get(e.tkey) is e.rec
                if e.l2:
                    l2_keys.add(e.tkey)
                if e.l3:
                    l3_keys.add(e.tkey)
    assert set(store.l1.keys()) == l1_keys
    homes = {"l1": 0, "l2": 0, "l3": 0}
    for seq in store.sequences():
        for t in store._tables[seq]:
            for e in t.entries:
                homes[e.home] += 1
    assert store.stats()["blocks"] == homes
    assert set(store.l2.keys()) == l2_keys
    if store.l3 is not None:
        # content records no live block references (kept by drop_sequence(keep_prefix=True) or left
        # by an earlier process) may stay in L3 until it needs the room
        on_disk = set(store.l3.keys())
        unreferenced = {k for k in on_disk - l3_keys if CONTENT_KEY.fullmatch(k) and k not in store._recs}
        assert on_disk - unreferenced == l3_keys
    else:
        assert not l3_keys


def random_chunk(rng: random.Random, kv_heads=2, head_dim=8, dtype=torch.float16, sizes=(1, 1, 1, 1, 2, 5, 9)):
    n = rng.choice(sizes)
    return torch.randn(kv_heads, n, head_dim).to(dtype), torch.randn(kv_heads, n, head_dim).to(dtype)


@pytest.fixture
def rng():
    return random.Random(1234)


def join_all(threads, errors: list, timeout: float = 80) -> None:
    """Start ``threads``, join them with a bound (a hang is a deadlock) and re-raise the first
    error a thread put in ``errors``."""
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=timeout)
    assert not any(th.is_alive() for th in threads), "deadlock"
    assert not errors, errors[0]


def assert_reads_back(st: KVStore, refs: dict) -> None:
    """Every (sequence, layer) of ``refs`` ({seq: Ref}) reads back bit-exact through gather."""
    for s, ref in refs.items():
        for (_, layer) in ref.chunks:
            rk, rv = ref.kv(s, layer)
            K, V = st.gather(s, layer)
            assert torch.equal(K, rk) and torch.equal(V, rv)
