"""Disk space: segment files sized to what they hold, space given back (purge, ``kvtier cache
clear``, expiry), a free-space check at open, and a full filesystem (a small tmpfs) that
stops L3 without losing what it holds, while the store goes on serving."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

from kvtier.tiers import DirectoryLockedError, DiskFullError, DiskTier
from kvtier.tiers import disk as disk_mod
from kvtier.tiers.disk import files, purge_directory


def seg_bytes_on_disk(path) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.startswith("seg-"))


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs (needs root); skipped where it cannot be mounted."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_fs(mnt, leave: int) -> str:
    """A filler file that leaves about ``leave`` bytes free on the filesystem."""
    st = os.statvfs(mnt)
    free = st.f_bavail * st.f_frsize
    p = os.path.join(mnt, "filler")
    with open(p, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return p


def test_tiny_run_costs_little_disk_and_sealed_segments_are_truncated(tmp_path):
    d = tmp_path / "d"
    with DiskTier(d, segment_bytes=64 << 20) as t:  # the default segment size
        t.put_many([(f"k{i}", b"x" * 500) for i in range(20)])
        assert seg_bytes_on_disk(d) <= 256 << 10  # not 64 MiB
        t.put_many([(f"b{i}", os.urandom(100_000)) for i in range(30)])  # grows, doubling
        assert t.get("b29") is not None and seg_bytes_on_disk(d) <= 8 << 20
    assert seg_bytes_on_disk(d) <= 3_100_000 + 20 * 600  # closed: truncated to the records
    with DiskTier(d, segment_bytes=1 << 20, capacity_bytes=16 << 20) as t:
        assert len(t) == 50
        for i in range(40):
            t.put(f"c{i}", os.urandom(200_000))
        sealed = [s for s in t._files.segs.values() if s is not t._files.head]
        assert sealed and all(s.size == s.used for s in sealed)
        assert all(t.get(f"c{i}") is not None for i in range(40))


def test_purge_removes_records_files_and_directory(tmp_path):
    d = tmp_path / "d"
    t = DiskTier(d)
    t.put_many([(f"k{i}", b"y" * 4000) for i in range(50)])
    freed = t.purge()
    assert freed >= 50 * 4000 and not d.exists()
    with pytest.raises(Exception):
        t.get("k0")
    keep = tmp_path / "shared"
    keep.mkdir()
    (keep / "notes.txt").write_text("not ours")
    with DiskTier(keep) as t2:
        t2.put("a", b"1")
    DiskTier(keep).purge()
    assert sorted(os.listdir(keep)) == ["notes.txt"]  # only kvtier's own files go


def test_cache_clear_command(tmp_path):
    d = tmp_path / "d"
    with DiskTier(d) as t:
        t.put_many([(f"k{i}", b"z" * 3000) for i in range(40)])
    t = DiskTier(d)
    with pytest.raises(DirectoryLockedError, match="in use"):
        purge_directory(d)  # a running tier's directory is left alone
    assert len(t) == 40
    t.close()
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.bin").write_bytes(b"1")
    with pytest.raises(ValueError, match="no kvtier L3 files"):
        purge_directory(other)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, "-c", "from kvtier.commands.cli import main; main()", "cache", "clear", str(d)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "removed" in r.stdout and not d.exists(), r.stderr
    r = subprocess.run([sys.executable, "-c", "from kvtier.commands.cli import main; main()", "cache", "clear", str(other)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "no kvtier L3 files" in r.stderr and "Traceback" not in r.stderr


def test_expire_by_age_and_size_spares_kept_keys(tmp_path):
    d = tmp_path / "d"
    kw = dict(segment_bytes=8 << 10, capacity_bytes=1 << 20)
    with DiskTier(d, **kw) as t:
        t.put_many([(f"old{i}", b"o" * 1000) for i in range(20)])
    hour_ago = time.time() - 3600
    for n in os.listdir(d):
        if n.startswith("seg-"):
            os.utime(d / n, (hour_ago, hour_ago))
    with DiskTier(d, **kw) as t:
        in_head = {k for k in t.keys() if t._catalog.records[k][0] == t._files.head.id}  # written to again now: young
        t.put_many([(f"new{i}", b"n" * 1000) for i in range(20)])
        with pytest.raises(ValueError, match="max_age_s"):
            t.expire(max_age_s=-1)
        gone = t.expire(max_age_s=600, keep=lambda k: k == "old3")
        old_left = {f"old{i}" for i in range(20) if t.contains(f"old{i}")}
        assert old_left == in_head | {"old3"}
        assert gone == 20 - len(old_left) > 10
        assert all(t.get(f"new{i}") == b"n" * 1000 for i in range(20))
        t.expire(max_bytes=5 * 1100, keep=lambda k: k == "old3")  # then the oldest go first
        assert t.contains("old3") and t.contains("new19") and not t.contains("new0")
        assert t.used_bytes - disk_mod.record_size(4, 1000) <= 5 * 1100
    with DiskTier(d, **kw) as t:
        assert t.contains("old3") and t.contains("new19") and not t.contains("new0")  # durable


def test_open_refuses_a_full_filesystem_and_warns_when_capacity_exceeds_it(small_fs):
    fill_fs(small_fs, leave=64 << 10)
    with pytest.raises(DiskFullError, match="bytes free"):
        DiskTier(small_fs / "l3", segment_bytes=4 << 20, capacity_bytes=64 << 20)
    os.unlink(small_fs / "filler")
    with pytest.warns(RuntimeWarning, match="disk fills before L3"):
        DiskTier(small_fs / "l3", segment_bytes=1 << 20, capacity_bytes=64 << 20).close()


def test_full_filesystem_keeps_earlier_records_and_close_does_not_raise(small_fs):
    fill_fs(small_fs, leave=1 << 20)
    d = small_fs / "l3"
    t = DiskTier(d, segment_bytes=256 << 10, capacity_bytes=64 << 20, durability="batch")
    stored = {}
    with pytest.raises(DiskFullError, match="disk full"):
        for i in range(10_000):
            v = os.urandom(20_000)
            t.put(f"k{i}", v)
            stored[f"k{i}"] = v
    assert len(stored) > 20 and all(t.get(k) == v for k, v in stored.items())
    t.close()  # the failure was reported already: close does not raise it again
    os.unlink(small_fs / "filler")
    with DiskTier(d, segment_bytes=256 << 10, capacity_bytes=64 << 20) as t:
        assert all(t.get(k) == v for k, v in stored.items())
        assert t.put("after", b"space is back")


def test_close_after_a_reported_failure_warns_instead_of_raising(tmp_path, monkeypatch):
    t = DiskTier(tmp_path / "d", durability="close")
    t.put("a", b"1")
    real = os.pwritev

    def enospc(fd, bufs, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", enospc)
    with pytest.raises(DiskFullError):
        t.put("b", b"2")
    monkeypatch.setattr(os, "pwritev", real)

    def eio(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "fdatasync", eio)
    with pytest.warns(RuntimeWarning, match="earlier failure"):
        t.close()
    t.close()  # and again: nothing left to do
    monkeypatch.undo()
    with DiskTier(tmp_path / "d") as t:
        assert t.get("a") == b"1" and t.get("b") is None


def _store_on_a_full_fs(mnt, **cfg):
    """A one-layer store on ``mnt`` with 1 MiB left free (the filler file's path returned), a
    step appending one block, and a check that every block reads back exact."""
    from tests.store.conftest import Ref, make_store

    filler = fill_fs(mnt, leave=1 << 20)
    st = make_store(mnt, num_layers=1, kv_heads=4, head_dim=64, device_tokens=32, host_bytes=256 << 10,
                    block_tokens=16, disk_segment_bytes=1 << 20, **cfg)
    ref, s = Ref(), st.add_sequence()
    g = torch.Generator().manual_seed(0)

    def step():
        k, v = (torch.randn(4, 16, 64, generator=g).half() for _ in range(2))
        st.append(s, 0, k, v)
        ref.add(s, 0, k, v)
        st.end_step()

    def exact():
        K, V = st.gather(s, 0)  # every block, from L1, L2 (its overflow too) and L3
        rk, rv = ref.kv(s, 0)
        assert torch.equal(K, rk) and torch.equal(V, rv)

    return st, filler, step, exact


def test_store_on_a_full_disk_stops_cleanly_and_serves_again_once_space_is_back(small_fs):
    st, filler, step, exact = _store_on_a_full_fs(small_fs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # capacity above the free space: expected here
        with pytest.raises(RuntimeError, match="full"):
            for _ in range(400):
                step()
    assert st.counters["l3_disk_full"] > 0
    exact()  # everything before the failure
    os.unlink(filler)
    for _ in range(40):  # space is back: the same store goes on
        step()
    exact()
    st.close()


def test_store_policy_for_kept_records_applies_at_open(tmp_path):
    from tests.store.conftest import make_store

    from kvtier.config import KVTierConfig

    for bad in (dict(disk_max_age_s=-1), dict(disk_max_age_s="1h"), dict(disk_kept_bytes=-5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            KVTierConfig(**bad)

    def fill(**kw):
        st = make_store(tmp_path, num_layers=1, fingerprint="fp", device_tokens=8, **kw)
        s = st.add_sequence()
        ids = torch.arange(64)
        st.note_tokens(s, ids)
        for i in range(16):
            st.append(s, 0, torch.full((2, 4, 8), float(i)).half(), torch.full((2, 4, 8), -float(i)).half())
        st.flush()
        st.drop_sequence(s, keep_prefix=True)  # its blocks stay in L3 for reuse
        n = len(st.l3)
        st.close()
        return n

    kept = fill()
    assert kept >= 10
    st = make_store(tmp_path, num_layers=1, fingerprint="fp", device_tokens=8, disk_kept_bytes=3 * 300)
    assert 0 < len(st.l3) < kept  # the oldest went
    st.close()
    st = make_store(tmp_path, num_layers=1, fingerprint="fp", device_tokens=8, disk_max_age_s=0)
    assert len(st.l3) == 0
    st.close()


def test_store_keeps_serving_sparse_steps_when_the_disk_fills_mid_run(small_fs):
    """Two conversations decoding sparsely while the filesystem under L3 fills: every step's reads
    stay exact up to the append that finds every tier full, which raises a clear error and stores
    nothing; every earlier block still reads back, a conversation can end on the full disk, and
    once space is back the same store serves old and new conversations."""
    from tests.store.conftest import Ref, make_store

    filler = fill_fs(small_fs, leave=768 << 10)
    kvh, hd, bt = 4, 64, 16  # one block of one layer: 16 KiB in fp16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # capacity above the free space: the point here
        st = make_store(small_fs, num_layers=2, kv_heads=kvh, head_dim=hd, device_tokens=4 * bt, block_tokens=bt,
                        host_bytes=1 << 20, disk_segment_bytes=256 << 10, attention="sparse",
                        budget_tokens=3 * bt, sink_tokens=bt, window_tokens=bt)
    ref, seqs = Ref(), [st.add_sequence(), st.add_sequence()]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(kvh, 1, hd, generator=g).half()

    def step(s):
        """A quarter block appended to each layer of ``s``, then a sparse read checked exact."""
        for layer in range(2):
            k, v = (torch.randn(kvh, bt // 4, hd, generator=g).half() for _ in range(2))
            st.append(s, layer, k, v)  # whole quarters: a refused append stores nothing
            ref.add(s, layer, k, v)
            K, V, pos, _ = st.gather_view(s, layer, st.select(s, layer, q))
            rk, rv = ref.kv(s, layer)
            assert torch.equal(K, rk[:, pos]) and torch.equal(V, rv[:, pos])
        st.end_step()

    def all_exact(s):
        for layer in range(2):
            K, V = st.gather(s, layer)  # every block, from L1, L2 and L3
            rk, rv = ref.kv(s, layer)
            assert torch.equal(K, rk) and torch.equal(V, rv)

    with pytest.raises(RuntimeError, match="L2 refused .*free space under disk_path"):
        for _ in range(4000):
            for s in seqs:
                step(s)
    assert st.counters["l3_disk_full"] > 0 and st.l3.stats()["records"] > 0
    tokens = st.seq_len(seqs[0], 0)
    for s in seqs:
        all_exact(s)  # L3 kept what it took before the disk filled
    with pytest.raises(RuntimeError, match="L2 refused"):
        for _ in range(8):  # still full: the same clear error, nothing stored
            step(seqs[0])
    assert st.seq_len(seqs[0], 0) - tokens <= 8 * bt
    st.drop_sequence(seqs[1])  # a conversation ends on the full disk: its copies go cleanly
    st.check_invariants()
    all_exact(seqs[0])
    os.unlink(filler)  # space is back: the same store goes on, for old and new conversations
    seqs[1] = st.add_sequence()
    for _ in range(8):
        for s in seqs:
            step(s)
    for s in seqs:
        all_exact(s)
    st.check_invariants()
    st.close()


def test_store_on_a_full_disk_keeps_blocks_in_l2_overflow_then_errors_then_drains(small_fs):
    st, filler, step, exact = _store_on_a_full_fs(small_fs, host_overflow_bytes=512 << 10)
    peak = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # capacity above the free space: expected here
        with pytest.raises(RuntimeError, match="full"):
            for _ in range(800):
                step()
                peak = max(peak, st.l2.stats()["overflow_used_bytes"])
    l2 = st.l2.stats()
    assert st.counters["l3_disk_full"] > 0 and l2["overflow_records"] > 0
    assert peak > 256 << 10 and l2["overflow_used_bytes"] <= 512 << 10  # over the ring, within the bound
    exact()
    st.check_invariants()  # blocks in the overflow are L2's
    os.unlink(filler)
    for _ in range(40):  # space is back: the overflow goes to L3 and the store goes on
        step()
    assert st.l2.stats()["overflow_records"] == 0 and st.l2.used_bytes <= 256 << 10
    exact()
    st.check_invariants()
    st.close()
