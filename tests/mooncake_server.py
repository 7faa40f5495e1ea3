"""A real Mooncake Store on loopback, for the tests and for ``bench/bench_tiers.py``: plain Python,
no pytest, so a script can import it.

One ``mooncake_master`` (its own HTTP metadata server on, admin port on) and one store server
(``mooncake_client``) that lends the pool its memory, each on free loopback ports. The binaries
come with the ``mooncake-transfer-engine-non-cuda`` wheel and sit next to the venv's python. No
persistence: a restarted master comes back empty (the store server registers its segment again),
as a crashed master would.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

_BIN = Path(sys.executable).parent


def _binary(name: str) -> str | None:
    p = _BIN / name
    return str(p) if p.exists() else None


def mooncake_unavailable() -> str | None:
    """Why a Mooncake pool cannot run here (None when it can): the client library must load
    (it needs libibverbs1/librdmacm1 even for TCP) and both binaries must be installed."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        return f"the Mooncake client does not load ({e}); pip install 'kvtier[mooncake]' and apt-get install " \
               f"libibverbs1 librdmacm1 (`make system-deps`)"
    for name in ("mooncake_master", "mooncake_client"):
        if _binary(name) is None:
            return f"{name} is not installed next to {sys.executable}"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout_s: float = 0.5) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.read()
    except OSError:
        return None


class MooncakePool:
    """A master and a store server on 127.0.0.1 that a test can kill and restart.

    Attributes:
        rpc_port, metadata_port, admin_port, holder_port: loopback ports (kept across restarts).
        segment_bytes: the memory the store server lends the pool.
        url: the ``mooncake://`` URL of this pool for ``remote_url`` (no segment of its own).
    """

    def __init__(self, workdir: Path, segment_bytes: int = 64 << 20, buffer_bytes: int = 16 << 20,
                 master_args: tuple[str, ...] = ()) -> None:
        why = mooncake_unavailable()
        assert why is None, why
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.rpc_port, self.metadata_port, self.admin_port, self.holder_port = (_free_port() for _ in range(4))
        self.segment_bytes, self.buffer_bytes = segment_bytes, buffer_bytes
        self.master_args = tuple(master_args)
        self.master: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None
        try:
            self.start()
            self.start_holder()
        except BaseException:
            self.kill()
            raise

    def url_with(self, **params) -> str:
        q = {"metadata": f"http://127.0.0.1:{self.metadata_port}/metadata",
             "admin": f"http://127.0.0.1:{self.admin_port}", "buffer_bytes": str(self.buffer_bytes),
             "local_hostname": "127.0.0.1", **{k: str(v) for k, v in params.items()}}
        return f"mooncake://127.0.0.1:{self.rpc_port}?" + "&".join(f"{k}={v}" for k, v in q.items())

    @property
    def url(self) -> str:
        return self.url_with()

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        env = dict(os.environ, GLOG_minloglevel="1")  # the master's INFO lines, one per request, left out
        with open(self.workdir / log, "ab") as f:
            return subprocess.Popen(args, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=subprocess.STDOUT, env=env)

    def _wait(self, proc: subprocess.Popen, ready, what: str, log: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.workdir / log).read_text(errors="replace")[-2000:]
                self.kill()
                raise RuntimeError(f"{what} did not come up (exit {proc.poll()}): {tail}")
            time.sleep(0.02)

    def start(self, timeout_s: float = 20.0) -> None:
        """Start the master (same ports as before) and wait until its admin port says it serves."""
        assert self.master is None or self.master.poll() is not None, "master already running"
        self.master = self._spawn([
            _binary("mooncake_master"), "-enable_http_metadata_server=true",
            "-http_metadata_server_host=127.0.0.1", f"-http_metadata_server_port={self.metadata_port}",
            "-rpc_address=127.0.0.1", f"-rpc_port={self.rpc_port}", "-metrics_host=127.0.0.1",
            f"-metrics_port={self.admin_port}", "-rpc_thread_num=2", "-client_ttl=3",
            *self.master_args], "master.log")

        def serving() -> bool:
            raw = _get(f"http://127.0.0.1:{self.admin_port}/health")
            return raw is not None and b'"service_ready":true' in raw

        self._wait(self.master, serving, "mooncake_master", "master.log", timeout_s)

    def segments(self) -> int:
        raw = _get(f"http://127.0.0.1:{self.admin_port}/get_segments_detail")
        return int(json.loads(raw).get("total_segments", 0)) if raw else 0

    def start_holder(self, timeout_s: float = 20.0) -> None:
        """Start the store server and wait until the master lists its segment."""
        self.holder = self._spawn([
            _binary("mooncake_client"), "-host=127.0.0.1", f"-port={self.holder_port}",
            f"-master_server_address=127.0.0.1:{self.rpc_port}",
            f"-metadata_server=http://127.0.0.1:{self.metadata_port}/metadata",
            f"-global_segment_size={self.segment_bytes}", f"-local_buffer_size={16 << 20}", "-protocol=tcp"],
            "holder.log")
        self.wait_segment(timeout_s)

    def wait_segment(self, timeout_s: float = 20.0) -> None:
        """Wait until the store server's segment is in the pool (after a master restart, too)."""
        self._wait(self.holder, lambda: self.segments() >= 1, "mooncake_client's segment", "holder.log", timeout_s)

    def kill_master(self) -> None:
        """SIGKILL the master (a crash: every record's metadata is gone with it)."""
        if self.master is not None and self.master.poll() is None:
            self.master.kill()
            self.master.wait(timeout=10)

    def restart_master(self) -> None:
        """Kill (if running) and start the master again; the store server re-registers its segment."""
        self.kill_master()
        self.start()
        self.wait_segment()

    def kill(self) -> None:
        for p in (self.holder, self.master):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)

    @property
    def running(self) -> bool:
        return self.master is not None and self.master.poll() is None


def start_mooncake_pool(workdir: Path, **kw) -> MooncakePool:
    """A pool on free loopback ports (retrying if another process grabbed a port first)."""
    last: Exception | None = None
    for _ in range(3):
        try:
            return MooncakePool(workdir, **kw)
        except RuntimeError as e:
            last = e
    raise RuntimeError(f"could not start a Mooncake pool: {last}")


def raw_client(pool: MooncakePool):
    """A plain Mooncake client on ``pool`` (what another program writing into it would use);
    the caller closes it."""
    from mooncake.store import MooncakeDistributedStore

    from kvtier.tiers.mooncake import MooncakeURL

    c = MooncakeURL(pool.url)
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", c.metadata, 0, 16 << 20, "tcp", "", c.master)
    assert rc == 0, f"setup returned {rc}"
    return store
