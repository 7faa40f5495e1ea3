"""The C sources under kvtier/csrc and their build: each compiles without a warning, the cached
object is named by the source's text, and a build that fails leaves callers their Python path."""
import os
import shutil
import subprocess
import warnings

import pytest

from kvtier import _clib
from kvtier.compress import cpu
from kvtier.store import score_cpu
from kvtier.tiers.disk import record_read, segment_scan

LIBRARIES = {"quant": cpu._LIB, "score": score_cpu._LIB, "segment_scan": segment_scan._LIB, "record_read": record_read._EXT}
needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


def test_every_source_has_its_library():
    assert sorted(p.stem for p in _clib.SOURCES.glob("*.c")) == sorted(LIBRARIES)
    for name, lib in LIBRARIES.items():
        assert lib.path == _clib.SOURCES / f"{name}.c"
        assert set(_clib.WARNINGS) <= set(lib.flags)


@needs_cc
@pytest.mark.parametrize("name", sorted(LIBRARIES))
def test_source_builds_without_warnings(name, tmp_path):
    """The build's own command line (its flags, -Wall -Wextra) with warnings made errors."""
    lib = LIBRARIES[name]
    r = subprocess.run([*lib.command(lib.path, tmp_path / f"{name}.so"), "-Werror"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def _probe(tmp_path, text: str) -> _clib.CLibrary:
    src = tmp_path / "probe.c"
    src.write_text(text)
    lib = _clib.CLibrary("probe", ["-O1", "-fPIC", "-shared"], lambda so: so.kvt_probe, "the probe's fallback")
    lib.path = src
    return lib


@needs_cc
def test_cached_object_is_named_by_the_source_text(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    lib = _probe(tmp_path, "int kvt_probe(void) { return 1; }\n")
    first = lib._compile()
    assert lib._compile() == first  # built once, then found
    lib.path.write_text("int kvt_probe(void) { return 2; }\n")
    second = lib._compile()
    assert second != first and second.exists()
    assert lib._open(second).kvt_probe() == 2


@needs_cc
def test_failed_build_warns_once_and_returns_none(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    lib = _probe(tmp_path, "int kvt_probe(void) { return }\n")
    with pytest.warns(RuntimeWarning, match="compiled probe code unavailable, the probe's fallback"):
        assert lib.load() is None
    assert "CalledProcessError" in lib.error and "probe.c" in lib.error
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lib.load() is None  # decided once per process


def test_missing_source_warns_and_returns_none(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    lib = _probe(tmp_path, "")
    lib.path = tmp_path / "absent.c"
    with pytest.warns(RuntimeWarning, match="compiled probe code unavailable"):
        assert lib.load() is None
    assert "FileNotFoundError" in lib.error
