"""One L3 record read in C: DiskTier's get and get_many copy each value out of its segment's
mapping through the functions of a compiled CPython extension (:func:`load`; its source is
``kvtier/csrc/record_read.c``).

What it does is what the Python path in ``reads`` does, in one call: check the record's
header against the index (magic, key and value lengths), copy the value into a new ``bytes`` and
check the data CRC (over the key asked for and the copy) with ISA-L's CRC-32. In Python those
are a dozen interpreter-level calls; for a 4 KiB record they cost more than the copy and the CRC
together, and twice what a plain ``f.read`` of the same bytes takes. The C call keeps the GIL
through the copy and the CRC of records up to ``_RELEASE_BYTES`` (1 MiB: about 0.1 ms), and lets
go of it only for larger ones: releasing it hands the interpreter to a waiting thread (a writer)
until that thread's Python reaches its next system call, and beside a writer thread that cost a
256 KiB get a quarter of its speed (``bench_tiers.py --only L3``: 0.66-0.77x an ``f.read`` with
the release above 64 KiB, 0.93-0.99x without), while a writer waits at most that 0.1 ms, far
below the interpreter's 5 ms switch interval.

A segment file truncated under us (by another process: the tier never shortens a mapped file)
would SIGBUS the first access to a page past its new end. The Python path probes the file's size
before each read (``lseek(SEEK_END)``, a system call: a fifth of a 4 KiB read). Here the header
and the copy run under a guard instead: a SIGBUS handler installed when the module loads jumps
back out of a guarded access (the read then returns None, as for a short file), and hands any
other SIGBUS to the handler that was there before it (faulthandler's, or the default: the process
dies as it would have). :func:`guarded` tells whether it is installed; where it is not, the read
probes the size as the Python path does.

Without a compiler, the Python headers or ISA-L, :func:`load` returns None and reads take the
Python path, with the same results.
"""
from __future__ import annotations

from kvtier._clib import CExtension
from kvtier._crc import c_address, crc32
from .segment import REC_HEADER_BYTES, REC_MAGIC

_RELEASE_BYTES = 1 << 20  # see the module docstring

_FLAGS = ["-O2", "-fPIC", "-shared", "-std=gnu11", f"-DKVT_REC_MAGIC={REC_MAGIC:#x}u",
          f"-DKVT_REC_HDR={REC_HEADER_BYTES}", f"-DKVT_RELEASE_BYTES={_RELEASE_BYTES}"]


def _declare(mod) -> None:
    """Install ISA-L's ``crc32_gzip_refl`` (the function ``kvtier._crc.crc32`` runs) and check
    that the module computes what the Python path does."""
    addr = c_address()
    if addr is None:
        raise OSError("ISA-L is not installed: reads keep zlib's CRC in Python")
    mod.set_crc(addr)
    probe = bytes(range(256)) * 41
    if any(mod.crc(probe, seed) != crc32(probe, seed) for seed in (0, 7, 0xFFFFFFFF)):
        raise OSError("the compiled CRC does not match kvtier._crc")


_EXT = CExtension("record_read", _FLAGS, _declare, "L3 reads parse records in Python")


def load():
    """The compiled module, its SIGBUS guard installed (where it can be), or None when the
    extension cannot be built here. Its functions (``mm`` a segment's mapping or None, ``limit``
    the bytes of it that may be touched, ``fd`` >= 0 to bound them by that file's size too where
    the guard is not installed):

    - ``read(mm, fd, limit, off, key, vlen) -> bytes | None``: the value of the record at
      ``off`` for ``key``, of ``vlen`` bytes, copied out once its header matched and its data
      CRC checked; None when any of that fails, or when ``mm`` is None.
    - ``read_into(mm, fd, limit, off, key, vlen, out) -> bool``: ``read`` into the writable
      buffer ``out`` instead (False where ``read`` gives None; ``out`` may then hold damaged
      bytes).
    - ``read_run(mm, fd, limit, todo, i, out) -> (next i, hits, bytes, failed keys)``: the
      records ``todo[i:]`` of one segment (``todo``: ``[(position, key, (segment id, offset,
      size, value length))]`` in file order; it stops at the first record of another segment),
      each read as ``read`` reads it and stored at ``out[position]``.
    - ``get(hot, segs, key) -> bytes | None | PASS``: DiskTier.get's look-up and read in one
      call for a key in the index's dict ``hot`` whose segment in ``segs`` is mapped (the value,
      or None when it does not read back); ``PASS`` for anything else, for the caller's own path.
    """
    mod = _EXT.load()
    if mod is not None:
        try:
            # also where a library loaded since replaced the handler (glog's, in the Mooncake
            # client; faulthandler): checked at every load, which every tier open makes
            mod.install_guard()
        except OSError:  # reads probe the file's size instead
            pass
    return mod


def guarded() -> bool:
    """Whether reads through :func:`load`'s module catch a SIGBUS instead of probing the file's size."""
    mod = _EXT.load()
    return mod is not None and mod.guarded()
