"""A throw-away redis-server for the benchmarks that need one (``bench_prefix``, ``bench_soak``):
a free loopback port, no persistence (a restart comes back empty). Not a benchmark itself
(``make bench-smoke`` runs ``bench_*.py`` only)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time


class LoopbackRedis:
    """Started on construction; ``url`` names it, ``kill`` stops it, ``restart`` brings it back
    on the same port. Raises FileNotFoundError when redis-server is not installed and
    RuntimeError when it does not answer PING."""

    def __init__(self, workdir: str) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed (Debian package redis-server)")
        os.makedirs(workdir, exist_ok=True)
        self.workdir = workdir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None
        self.start()

    def start(self, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.workdir, "--protected-mode", "yes"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL (a crash) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()
