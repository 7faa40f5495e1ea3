import os
import random
import threading

import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.store import KVStore
from kvtier.tiers.disk.segment import REC_HEADER_BYTES


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
    base = dict(block_tokens=4, device_tokens=16, host_bytes=8192, codec="fp16", policy="lru",
                max_sequences=4)
    if tmp_path is not None:
        base.update(disk_path=str(tmp_path / "l3"), disk_segment_bytes=1 << 16, disk_bytes=64 << 20)
    base.update(kw)
    return KVStore(KVTierConfig(**base), num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim,
                   dtype=dtype, device=device, fingerprint=fingerprint)


def check_invariants(store: KVStore) -> None:
    """After flush(): one consistent picture of every block across the tiers (KVStore's own check)."""
    store.check_invariants()


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


def sequences_on_threads(st: KVStore, n: int, body) -> dict:
    """Run ``body(s, ref, rng, gen)`` on ``n`` threads at once, each with a sequence ``s`` of its
    own, a Ref for what it appends and a random.Random and torch.Generator seeded by its index;
    bounded and re-raised by :func:`join_all`. Returns {seq: Ref}."""
    refs, errors = {}, []

    def run(seed):
        try:
            s = st.add_sequence()
            ref = refs[s] = Ref()
            body(s, ref, random.Random(seed), torch.Generator().manual_seed(seed))
        except BaseException as e:  # surfaced by the main thread
            errors.append(e)

    join_all([threading.Thread(target=run, args=(i,)) for i in range(n)], errors)
    return refs


def assert_gathers(st: KVStore, ref: Ref, s: int, layer: int) -> None:
    """``st.gather`` of (s, layer) is everything ``ref`` recorded for it, bit-exact."""
    rk, rv = ref.kv(s, layer)
    K, V = st.gather(s, layer)
    assert torch.equal(K, rk) and torch.equal(V, rv)


def assert_rows(ref: Ref, s: int, layer: int, K: torch.Tensor, V: torch.Tensor, pos: torch.Tensor) -> None:
    """K and V (from gather_blocks or gather_view) hold the tokens ``pos`` of (s, layer)."""
    rk, rv = ref.kv(s, layer)
    assert torch.equal(K, rk[:, pos]) and torch.equal(V, rv[:, pos])


def assert_reads_back(st: KVStore, refs: dict) -> None:
    """Every (sequence, layer) of ``refs`` ({seq: Ref}) reads back bit-exact through gather."""
    for s, ref in refs.items():
        for (_, layer) in ref.chunks:
            assert_gathers(st, ref, s, layer)


def corrupt_l3_record(l3, key: str) -> None:
    """Flip one byte of the value of ``key``'s record in its L3 segment file."""
    sid, off, _, _ = l3._catalog.records.lookup(key)
    at = off + REC_HEADER_BYTES + len(key.encode()) + 1
    fd = os.open(l3._files.segs[sid].path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x40]), at)
    finally:
        os.close(fd)
