"""A real redis-server on a loopback port, for the tests and for the benchmarks that need one
(``bench/bench_prefix.py``, ``bench/bench_soak.py``, ``bench/vllm_ttft.py``): plain Python, no
pytest, so a script can import it.

The server is the Debian package's binary (``make system-deps`` installs it in CI). No
persistence: ``--save ''`` and ``--appendonly no``, so a restart comes back empty, as a crashed
cache node would.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
                                                else None)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A redis-server process on 127.0.0.1:``port`` that a test can kill and restart.

    Attributes:
        port: the loopback port (kept across restarts).
        url: ``redis://127.0.0.1:<port>/0``.
        workdir: the server's working directory (its log file lives there).
    """

    def __init__(self, workdir: Path, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        assert REDIS_SERVER is not None, "redis-server is not installed"
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or _free_port()
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server (on the same port as before) and wait until it answers PING."""
        assert self.proc is None or self.proc.poll() is not None, "server already running"
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--logfile", "redis.log",
                "--protected-mode", "yes", *self.extra_args]
        self.proc = subprocess.Popen(args, cwd=self.workdir, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while not _ping(self.port):
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                log = self.workdir / "redis.log"
                err += log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} on port {self.port}: {err}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port} within {timeout_s}s")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL the server (a crash: no clean shutdown) and wait for it to exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()

    def restart(self) -> None:
        """Kill (if running) and start again on the same port; the data is gone (no persistence)."""
        self.kill()
        self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def start_redis_server(workdir: Path, extra_args: tuple[str, ...] = ()) -> RedisServer:
    """Start a server on a free loopback port (retrying if another process grabbed the port first)."""
    last: Exception | None = None
    for _ in range(5):
        try:
            return RedisServer(workdir, extra_args=extra_args)
        except RuntimeError as e:
            last = e
    raise RuntimeError(f"could not start redis-server: {last}")
