"""Crash safety: a writer process is SIGKILLed at random moments while it appends, deletes and
compacts; after every kill the directory is reopened and checked.

Values are a pure function of their key, so any value the tier returns can be checked even for
records whose put was cut short.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import time

from kvtier.tiers import DiskTier

ITERATIONS = 25
_CTX = mp.get_context("fork")


def value_of(key: str) -> bytes:
    h = hashlib.sha256(key.encode()).digest()
    n = int.from_bytes(h[:2], "little") % 6000
    return (h * (n // 32 + 1))[:n]


def open_tier(path):
    return DiskTier(path, capacity_bytes=256 << 20, segment_bytes=32 << 10, durability="batch",
                    compact_threshold=0.5)


def _writer(path, wfd, gen, live, seed):
    rng = random.Random(seed)
    t = open_tier(path)
    os.write(wfd, b"R\n")
    live = list(live)
    for op in range(1_000_000):
        if live and rng.random() < 0.3:
            k = live.pop(rng.randrange(len(live)))
            os.write(wfd, f"d {k}\n".encode())  # from here on the delete may or may not land
            t.delete(k)  # durability="batch": the tombstone is synced when this returns
            os.write(wfd, f"D {k}\n".encode())
        else:
            keys = [f"g{gen}-{op}-{i}" for i in range(rng.randint(1, 5))]
            t.put_many([(k, value_of(k)) for k in keys])  # one fdatasync for the batch
            live.extend(keys)
            os.write(wfd, ("P " + " ".join(keys) + "\n").encode())


def test_sigkill_during_writes_never_loses_synced_or_returns_torn(tmp_path):
    path = tmp_path / "l3"
    rng = random.Random(1234)
    synced: set[str] = set()
    deleted: set[str] = set()
    for gen in range(ITERATIONS):
        r, w = os.pipe()
        p = _CTX.Process(target=_writer, args=(path, w, gen, sorted(synced), rng.random()))
        p.start()
        os.close(w)
        with os.fdopen(r, "rb") as pipe:
            assert pipe.readline() == b"R\n"
            time.sleep(rng.uniform(0.005, 0.12))
            os.kill(p.pid, signal.SIGKILL)
            p.join()
            lines = pipe.read().decode().splitlines()
        assert p.exitcode == -signal.SIGKILL
        for line in lines:  # only complete lines: the writer reported them after the sync
            kind, *keys = line.split(" ")
            if kind == "P":
                synced.update(keys)
            elif kind == "d":
                synced.difference_update(keys)
            elif kind == "D":
                deleted.update(keys)
        with open_tier(path) as t:
            for k in synced:
                assert t.get(k) == value_of(k), f"synced record {k} lost after kill {gen}"
            for k in deleted:
                assert t.get(k) is None, f"synced delete of {k} undone after kill {gen}"
            for k in t.keys():  # whatever else survived is whole, never torn
                got = t.get(k)
                assert got is None or got == value_of(k)
            s = t.stats()
            assert s["corrupt"] == 0 and s["scan_corrupt"] == 0, s
    assert len(synced) > 50 and len(deleted) > 10
