"""Run a function in a forked child process (torch is already imported, so this is fast)."""
from __future__ import annotations

import multiprocessing as mp
import traceback

_CTX = mp.get_context("fork")


def _trampoline(conn, fn, args):
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as exc:  # report to the parent, which re-raises
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def run_in_child(fn, *args, timeout: float = 60.0):
    """fn(*args) in a forked process; returns its (picklable) result or raises RuntimeError."""
    parent, child = _CTX.Pipe(duplex=False)
    p = _CTX.Process(target=_trampoline, args=(child, fn, args))
    p.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise RuntimeError("child process timed out")
        status, value = parent.recv()
    finally:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
    if status != "ok":
        raise RuntimeError(value)
    return value
