"""How vLLM's scheduler asks the worker what the store holds: a Unix socket.

vLLM runs the connector twice, in two processes: the scheduler half (engine core) decides how
many prompt tokens to load, the worker half owns the KV pages, and so the store. The answer
has to be exact (a block counted but not loadable costs a failed step and a recomputation)
and include L2, which lives in the worker's memory. Sharing L3 would not do (one DiskTier
owns a directory, and L2 would be invisible), so the worker answers, over an ``AF_UNIX``
socket in an owner-only directory: one request, one reply, JSON (no pickle).

```
 scheduler ── {"op": "lookup", "hashes": [h0, h1, ...]} ──► worker: BlockStore.lookup
           ◄── {"n": 3} ──────────────────────────────────  (leading blocks held)
           ── {"op": "stats"} ──► ◄── {...}                  (tests, bench)
```
The socket is named after vLLM's ``engine_id``, which both halves share.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 60.0  # the worker starts its server before the scheduler exists; this is slack


def socket_path(engine_id: str) -> str:
    """Where the worker of engine ``engine_id`` listens (a 0o700 directory of this user)."""
    root = os.path.join(tempfile.gettempdir(), f"kvtier-vllm-{os.getuid()}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    os.chmod(root, 0o700)
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:64]
    return os.path.join(root, f"{safe}.sock")


class LookupServer:
    """Answers lookups and stats requests on ``path`` from a thread per connection.

    Args:
        path: socket path (:func:`socket_path`); a stale file there is replaced.
        handlers: op name -> function of the request dict returning a JSON-able reply.
    """

    def __init__(self, path: str, handlers: dict) -> None:
        self.path = path
        self._handlers = handlers
        if os.path.exists(path):
            os.unlink(path)
        self._listener = Listener(path, family="AF_UNIX")
        os.chmod(path, 0o600)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kvtier-vllm-lookup", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="kvtier-vllm-lookup-conn",
                             daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    req = json.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    return
                except ValueError as e:
                    reply = {"error": f"bad request: {e}"}
                else:
                    fn = self._handlers.get(req.get("op")) if isinstance(req, dict) else None
                    try:
                        reply = fn(req) if fn else {"error": f"unknown op {req!r:.80}"}
                    except Exception as e:  # the scheduler treats an error as "nothing held"
                        log.exception("kvtier lookup server: %r failed", req.get("op"))
                        reply = {"error": repr(e)}
                try:
                    conn.send_bytes(json.dumps(reply).encode())
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        finally:
            if os.path.exists(self.path):
                os.unlink(self.path)


class LookupClient:
    """The scheduler's side: one connection, opened on first use and reopened after an error."""

    def __init__(self, path: str, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.path = path
        self.connect_timeout_s = connect_timeout_s
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._warned = False

    def _connect(self) -> Connection:
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                return Client(self.path, family="AF_UNIX")
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def call(self, req: dict) -> dict:
        """Send ``req``, return the reply; raises OSError/EOFError when the worker is unreachable."""
        with self._lock:
            if self._conn is None:
                self._conn = self._connect()
            try:
                self._conn.send_bytes(json.dumps(req).encode())
                reply = json.loads(self._conn.recv_bytes())
            except (OSError, EOFError):
                self._conn.close()
                self._conn = None
                raise
        if "error" in reply:
            raise OSError(f"kvtier worker: {reply['error']}")
        return reply

    def lookup(self, hashes: list[str]) -> int:
        """Leading blocks the worker's store holds; 0 (one warning) when it cannot be asked."""
        if not hashes:
            return 0
        try:
            return int(self.call({"op": "lookup", "hashes": hashes})["n"])
        except (OSError, EOFError) as e:
            if not self._warned:
                log.warning("kvtier: the worker's store cannot be asked (%s); prompts are computed, "
                            "not loaded, until it answers", e)
                self._warned = True
            return 0

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
