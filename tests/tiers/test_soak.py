"""Soak (slow): bench/bench_soak.py run for a bounded time, SIGKILLing and restarting a store
with L3 on one directory and, where redis-server is installed, L4 on a loopback Redis that is
itself SIGKILLed and restarted (empty) every few rounds; every synced block must read back
bit-exact from L3, and from L4 alone since its last restart, and nothing corrupt be served."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.redis_server import REDIS_SERVER

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_kill_and_restart_loses_nothing_synced(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    redis = ["--redis", "auto", "--redis-kill-every", "4"] if REDIS_SERVER else []
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_soak.py"), "--seconds", "45",
                        "--json", "--dir", str(tmp_path), "--seed", "5", *redis],
                       capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # each restart checks from L3 and, with Redis, from L4 too: fewer rounds fit in the time
    assert res["kills"] >= (6 if redis else 8) and res["lock_takeovers"] == res["rounds"] - 1, res
    assert res["bytes_lost"] == 0 and res["blocks_lost"] == res["final_blocks_lost"] == 0, res
    assert res["corrupt_served"] == 0 and res["final_corrupt"] == 0, res
    assert res["final_blocks_verified"] > 500 and res["blocks_verified"] > 0
    assert res["kept_records"] > 0 and res["records_after_reclaim"] == 0
    assert res["disk_bytes_after_reclaim"] <= 1 << 20 < res["disk_bytes_before_reclaim"]
    if redis:
        assert res["l4"] and res["redis_restarts"] >= 1, res
        assert res["l4_blocks_verified"] > 0 and res["final_l4_blocks_verified"] > 0, res
        assert res["l4_corrupt_served"] == res["final_l4_corrupt"] == 0, res
        # synced to the Redis running now: none may be missing (a restart resets what counts)
        assert res["l4_blocks_lost"] == res["final_l4_blocks_lost"] == 0, res
    assert os.listdir(tmp_path) == []  # the bench removed its directory (and its server's)
