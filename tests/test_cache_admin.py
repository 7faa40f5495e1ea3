"""`kvtier cache` and kvtier.cache_admin: ls agrees with what was stored, verify finds every
record corrupted, pins by token prefix, and a directory a live writer process serves from."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from kvtier.cache_admin import CacheDirectory
from kvtier.commands.cli import main
from kvtier.compress import get_codec
from kvtier.compress.bytestage import ByteStage
from kvtier.store.blockrecord import pack_block
from kvtier.store.prefix import chained_block_hashes
from kvtier.tiers import DiskTier

FP_A, FP_B = "m" + "a" * 32, "m" + "b" * 32
IDS = list(range(100, 164))  # 4 blocks of 16 tokens


def record(codec: str) -> bytes:
    c = get_codec(codec)
    x = torch.randn(3, 16, 64).half()
    return ByteStage("lz4").pack(pack_block(c.encode(x), c.encode(x)))


def fill(path) -> dict[str, bytes]:
    stored = {}
    for fp, codec in ((FP_A, "int8"), (FP_B, "int4")):
        for h in chained_block_hashes(IDS, 16, fp):
            for layer in range(2):
                stored[f"{fp}/{layer}/{h}"] = record(codec)
    t = DiskTier(str(path), capacity_bytes=8 << 20, segment_bytes=1 << 20)
    t.put_many(stored.items())
    t.close()
    return stored


def test_ls_agrees_with_what_was_stored_and_verify_finds_every_corrupted_record(tmp_path, capsys):
    path = tmp_path / "l3"
    stored = fill(path)
    cd = CacheDirectory(path)
    groups = {(g.identity, g.codec): g for g in cd.ls()}
    assert set(groups) == {(FP_A, "int8"), (FP_B, "int4")}
    assert all(g.records == 8 for g in groups.values())
    assert sum(g.bytes for g in groups.values()) == cd.stat()["live_bytes"]
    assert cd.verify() == []
    # damage three records' values in the segment file
    recs = {r.key: r for r in cd.records()}
    victims = sorted(stored)[1::5][:3]
    seg = next(p for p in os.listdir(path) if p.startswith("seg-"))
    with open(path / seg, "r+b") as f:
        for k in victims:
            r = recs[k]
            f.seek(r.offset + 24 + len(k) + r.value_bytes // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    assert sorted(r.key for r in cd.verify()) == victims
    assert main(["cache", "verify", str(path)]) == 1
    assert main(["cache", "verify", str(path), "--drop"]) == 0
    assert cd.verify() == [] and cd.stat()["records"] == len(stored) - 3
    capsys.readouterr()
    assert main(["cache", "ls", str(path)]) == 0
    assert FP_A in capsys.readouterr().out


def test_pin_a_token_prefix_and_evict_by_identity_keeps_it(tmp_path):
    path = tmp_path / "l3"
    stored = fill(path)
    cd = CacheDirectory(path)
    assert cd.pin("sys", IDS[:32]) == 2 * 2  # two blocks, for each of the two identities
    assert main(["cache", "pin", str(path), "one", "--tokens", ",".join(map(str, IDS[:16]))]) == 0
    assert set(cd.pins()) == {"sys", "one"}
    assert cd.evict(identity=FP_A) == 8 - 2 * 2  # every layer of the two pinned blocks stays
    t = DiskTier(str(path), capacity_bytes=8 << 20, segment_bytes=1 << 20)
    pinned = [k for k in stored if k.startswith(FP_A) and t.pinned(k)]
    assert len(pinned) == 4 and all(t.contains(k) for k in pinned)
    t.close()
    cd.unpin("sys")
    with pytest.raises(SystemExit):
        main(["cache", "unpin", str(path), "sys"])  # unknown label: a message, no traceback
    with pytest.raises(ValueError, match="evict needs"):
        cd.evict()


_WRITER = """
import sys, time
from kvtier.tiers import DiskTier
t = DiskTier(sys.argv[1], capacity_bytes=8 << 20, segment_bytes=1 << 20, durability="never")
print("ready", flush=True)
i = 0
while sys.stdin.readline().strip() != "stop":
    t.put_many([(f"m{'c' * 32}/0/{i * 64 + j:032x}", bytes(3000)) for j in range(64)])
    i += 1
    print("wrote", flush=True)
t.close()
"""


def test_a_directory_a_live_writer_serves_from(tmp_path, capsys):
    path = tmp_path / "l3"
    fill(path)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    w = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
    try:
        assert w.stdout.readline().strip() == "ready"
        cd = CacheDirectory(path)
        for _ in range(3):
            w.stdin.write("go\n")
            w.stdin.flush()
            time.sleep(0.05)
            assert cd.verify() == []  # reads while it writes: nothing reported damaged
            assert cd.stat()["serving_pid"] == w.pid
            assert w.stdout.readline().strip() == "wrote"
        assert cd.pin("sys", IDS[:16]) == 2  # pins are safe while serving
        for op in (lambda: cd.evict(identity=FP_A), lambda: cd.verify(drop=True) or cd._open_tier(), cd.clear):
            with pytest.raises(ValueError, match=f"in use by a running kvtier \\(pid {w.pid}\\)"):
                op()
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(["cache", "clear", str(path)])
        assert e.value.code == 2 and "in use" in capsys.readouterr().err
    finally:
        w.stdin.write("stop\n")
        w.stdin.flush()
        w.wait(timeout=30)
    assert CacheDirectory(path).stat()["records"] == 16 + 3 * 64
