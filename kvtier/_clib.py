"""C sources compiled on first use with the system compiler and loaded with ctypes.

Each source is one self-contained file ``kvtier/csrc/<name>.c`` (shipped as package data), read
when its library is first loaded: the compress kernel (``quant``, wrapped by
``kvtier/compress/cpu.py``), the block scorer (``score``, ``kvtier/store/score_cpu.py``) and the L3
segment scan and record read (``segment_scan``, ``record_read``, ``kvtier/tiers/disk/``). The shared object is
cached under ``$KVTIER_CACHE_DIR`` (default ``~/.cache/kvtier``, owner-only), named by a hash of
the source file's text, flags, compiler and CPU, so an edited source is rebuilt and a cache
directory shared between machines never hands one CPU's ``-march=native`` build to another.
Every build has the compiler's warnings on (:data:`WARNINGS`; ``tests/test_csrc.py`` builds each
source with them as errors). No compiler (or a failed build) is not an error:
:meth:`CLibrary.load` returns None once, with a warning, and callers take their Python path.
:class:`CExtension` builds a CPython extension module the same way, for hot paths where a
ctypes call's own cost (about a microsecond with its argument conversions) would be most of the
work.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable

SOURCES = Path(__file__).parent / "csrc"
WARNINGS = ["-Wall", "-Wextra"]


def cache_dir() -> Path:
    root = os.environ.get("KVTIER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvtier")
    p = Path(root)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    return p


def cpu_id() -> str:
    """What -march=native depends on: a shared cache dir must not hand one CPU's build to another."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


class CLibrary:
    """One C source, built and loaded once per process (thread-safe).

    Args:
        name: the source is ``kvtier/csrc/<name>.c``; the cached object ``kvtier_<name>_<hash>.so``.
        flags: compiler flags (``-shared -fPIC`` included; ``-D`` for the constants the source
            takes from Python); :data:`WARNINGS` are added.
        declare: sets ``argtypes``/``restype`` of the loaded functions.
        fallback: what callers do without it, for the warning (e.g. "select() uses torch ops").
    """

    def __init__(self, name: str, flags: list[str], declare: Callable[[ctypes.CDLL], None],
                 fallback: str) -> None:
        self.name, self.declare, self.fallback = name, declare, fallback
        self.path = SOURCES / f"{name}.c"
        self.flags = [*flags, *WARNINGS]
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self.error: str | None = None

    def _build(self):
        return self._open(self._compile())

    def _open(self, path: Path):
        lib = ctypes.CDLL(str(path))
        self.declare(lib)
        return lib

    def command(self, src: Path, out: Path) -> list[str]:
        """The compiler's command line that builds ``src`` into ``out``."""
        return [os.environ.get("CC", "cc"), *self.flags, str(src), "-o", str(out), "-lm"]

    def _compile(self) -> Path:
        text = self.path.read_text()  # (a missing file is an OSError: the callers' fallback)
        key = "\0".join([text, " ".join(self.command(Path("src.c"), Path("out.so"))), sys.platform, cpu_id()])
        tag = hashlib.sha256(key.encode()).hexdigest()[:16]
        out = cache_dir() / f"kvtier_{self.name}_{tag}.so"
        if not out.exists():
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                src = Path(tmp) / f"{self.name}.c"
                src.write_text(text)  # the text the name hashes, not whatever the file holds by now
                so = Path(tmp) / f"{self.name}.so"
                subprocess.run(self.command(src, so), check=True, capture_output=True, timeout=120)
                os.chmod(so, 0o700)
                os.replace(so, out)  # atomic: concurrent builders race harmlessly
        return out

    def load(self):
        """The loaded library, or None (and :attr:`error` says why) when it cannot be built."""
        if self._lib is not None or self.error is not None:
            return self._lib
        with self._lock:
            if self._lib is None and self.error is None:
                try:
                    self._lib = self._build()
                except (OSError, subprocess.SubprocessError) as e:  # no compiler, or it failed
                    detail = getattr(e, "stderr", b"") or b""
                    self.error = f"{type(e).__name__}: {e} {detail.decode(errors='replace')[:500]}"
                    warnings.warn(f"kvtier: compiled {self.name} code unavailable, {self.fallback} ({self.error})",
                                  RuntimeWarning, stacklevel=3)
        return self._lib


class CExtension(CLibrary):
    """A CPython extension module built from one C source (``PyInit_<name>``), loaded as
    module ``kvtier_<name>``; ``declare(module)`` checks it (raising OSError refuses it, as a
    failed build is refused). Built against this interpreter's headers, and named by them and
    its ABI tag as well, so another Python never loads it."""

    def __init__(self, name: str, flags: list[str], declare: Callable, fallback: str) -> None:
        include = sysconfig.get_paths()["include"]
        super().__init__(name, [*flags, f"-I{include}", f"-DKVT_ABI={sys.implementation.cache_tag}"],
                         declare, fallback)

    def _open(self, path: Path):
        name = f"kvtier_{self.name}"
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
        if spec is None:
            raise OSError(f"cannot load {path}")
        try:  # (dlopen can refuse it, e.g. with no static TLS left: then the callers' fallback)
            mod = importlib.util.module_from_spec(spec)
            loader.exec_module(mod)
        except ImportError as e:
            raise OSError(f"cannot load {path}: {e}") from e
        self.declare(mod)
        return mod
