"""The one Mooncake client of this process per pool configuration, shared by every MooncakeTier
opened on it, set up on a thread of its own and closed at process exit."""
from __future__ import annotations

import atexit
import socket
import threading
import time

from .mooncake_url import MooncakeURL

class _SharedClient:
    """The one Mooncake client of this process for one pool configuration, shared by every
    MooncakeTier opened on it (different prefixes, the store and the vLLM connector): a client's
    setup and close each hold a library-wide lock (close ~1 s), and a process needs one
    transfer engine per pool, as it needs one connection pool per Redis server.

    It is set up on a thread of its own (setup blocks for minutes when the master hangs); callers
    wait for it until ``deadline``. A failed setup leaves ``store`` None and ``rc`` the code, and
    the next :meth:`start` tries again. The client leaves the master at process exit."""

    def __init__(self, cfg: "MooncakeURL") -> None:
        self.cfg = cfg
        self.lock = threading.Lock()  # guards thread, store, rc, deadline
        self.thread: threading.Thread | None = None
        self.done = threading.Event()
        self.store = None
        self.rc: int | None = None
        self.deadline = 0.0

    def start(self, wait_s: float) -> None:
        """Begin a setup unless one is under way or done."""
        with self.lock:
            if self.thread is not None or self.store is not None:
                return
            self.done.clear()
            self.deadline = time.monotonic() + wait_s
            self.thread = threading.Thread(target=self._setup, name="kvtier-mooncake-setup", daemon=True)
            self.thread.start()

    @property
    def connecting(self) -> bool:
        return self.thread is not None

    def wait(self):
        """The client once set up (waiting until the deadline of the attempt under way), else None."""
        self.done.wait(max(0.0, self.deadline - time.monotonic()))
        return self.store

    def _setup(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        c = self.cfg
        host = c.local_hostname or _route_address(c.host, c.rpc_port)
        store = MooncakeDistributedStore()
        rc = store.setup(host, c.metadata, c.segment_bytes, c.buffer_bytes, c.protocol, "", c.master)
        # the client's glog puts its own SIGBUS handler in place of L3's read guard: put it back
        from .disk import record_read

        record_read.load()
        with self.lock:
            self.rc, self.thread = rc, None
            if rc == 0:
                self.store = store
        self.done.set()


_clients: dict[tuple, _SharedClient] = {}
_clients_lock = threading.Lock()


def _shared_client(cfg: "MooncakeURL") -> _SharedClient:
    key = (cfg.master, cfg.metadata, cfg.segment_bytes, cfg.buffer_bytes, cfg.protocol, cfg.local_hostname)
    with _clients_lock:
        if key not in _clients:
            _clients[key] = _SharedClient(cfg)
        return _clients[key]


@atexit.register
def _close_clients() -> None:
    with _clients_lock:
        stores = [c.store for c in _clients.values() if c.store is not None]
        _clients.clear()
    for store in stores:
        store.close()


def _route_address(host: str, port: int) -> str:
    """The local address this host reaches ``host`` from (no packet is sent: a UDP connect)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
