"""One L3 record read in C: DiskTier's get and get_many copy each value out of its segment's
mapping through the functions of a compiled CPython extension (:func:`load`).

What it does is what the Python path in ``diskread`` does, in one call: check the record's
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

import ctypes
from kvtier._clib import CExtension
from kvtier._crc import IMPLEMENTATION, crc32
from .segfile import REC_HEADER_BYTES, REC_MAGIC

_RELEASE_BYTES = 1 << 20  # see the module docstring

_SRC = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <signal.h>
#include <setjmp.h>

typedef uint32_t (*crc_fn)(uint32_t, const unsigned char *, uint64_t);
static crc_fn CRC = NULL;

/* The SIGBUS guard: a thread's guarded access sets ``guard``; the handler jumps back to it. */
static __thread sigjmp_buf *volatile guard __attribute__((tls_model("initial-exec")));
static struct sigaction prev_bus;
static int guarded = 0;

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    sigjmp_buf *g = guard;
    if (g != NULL) {
        guard = NULL;
        siglongjmp(*g, 1);  /* SA_NODEFER: SIGBUS is not left blocked */
    }
    /* Not ours: put back what was there before and return. The access that faulted runs again
       and faults to it (faulthandler's traceback, or the default death); calling it from here
       instead could loop where it also chains to us. Reads probe the size from now on. */
    guarded = 0;
    sigaction(SIGBUS, &prev_bus, NULL);
}

static PyObject *is_guarded(PyObject *self, PyObject *unused) { return PyBool_FromLong(guarded); }

static PyObject *install_guard(PyObject *self, PyObject *unused) {
    if (!guarded) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_sigbus;
        sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        if (sigaction(SIGBUS, &sa, &prev_bus) != 0) return PyErr_SetFromErrno(PyExc_OSError);
        guarded = 1;
    }
    Py_RETURN_TRUE;
}

/* The header at ``h`` checked against (klen, vlen), then the value copied to ``dst`` and the
   CRC run on over the copy (``*crc``): 0, 1 when the header does not match, -1 on SIGBUS. */
static int copy_record(const uint8_t *h, Py_ssize_t klen, long long vlen, unsigned char *dst,
                       uint32_t *crc) {
    sigjmp_buf env;
    if (guarded) {
        if (sigsetjmp(env, 0)) return -1;
        guard = &env;
    }
    uint32_t magic, vl, dcrc;
    uint16_t kl;
    memcpy(&magic, h, 4);
    memcpy(&kl, h + 10, 2);
    memcpy(&vl, h + 12, 4);
    memcpy(&dcrc, h + 16, 4);
    int bad = magic != MAGIC || kl != klen || vl != vlen;
    if (!bad) memcpy(dst, h + HDR + klen, (size_t)vlen);
    guard = NULL;
    if (!bad) bad = CRC(*crc, dst, (uint64_t)vlen) != dcrc;
    return bad;
}

static PyObject *set_crc(PyObject *self, PyObject *arg) {
    unsigned long long a = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    CRC = (crc_fn)(uintptr_t)a;
    Py_RETURN_NONE;
}

/* crc(data, seed): the CRC-32 of a buffer through the function set_crc installed. */
static PyObject *crc(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || CRC == NULL) {
        PyErr_SetString(PyExc_TypeError, "crc(data, seed), after set_crc");
        return NULL;
    }
    unsigned long seed = PyLong_AsUnsignedLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    uint32_t c = CRC((uint32_t)seed, (const unsigned char *)b.buf, (uint64_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(c);
}

/* ``mm``'s buffer into ``b``, with ``*limit`` cut to its length and, where the guard is not
   installed and ``fd`` >= 0, to that file's size now: -1 (an exception set) on an error. */
static int open_mapping(PyObject *mm, long long fd, long long *limit, Py_buffer *b) {
    if (PyObject_GetBuffer(mm, b, PyBUF_SIMPLE) < 0) return -1;
    if (b->len < *limit) *limit = b->len;
    if (fd >= 0 && !guarded) {
        off_t end = lseek((int)fd, 0, SEEK_END);
        if (end < *limit) *limit = end < 0 ? 0 : end;
    }
    return 0;
}

/* The value of the record at ``off`` of ``base`` (``limit`` bytes touchable) for the key ``kb``
   copied to ``dst`` and its CRC checked: 0, or nonzero when it is out of bounds, its header does
   not match or its CRC fails (or it SIGBUSes). The GIL is let go of for a large value. */
static int copy_value(const uint8_t *base, long long limit, long long off, const char *kb, Py_ssize_t klen,
                      long long vlen, unsigned char *dst) {
    if (off < 0 || vlen < 0 || off + HDR + klen + vlen > limit) return 1;
    uint32_t c = CRC(0, (const unsigned char *)kb, (uint64_t)klen);
    int bad;
    if (vlen > RELEASE) {
        Py_BEGIN_ALLOW_THREADS
        bad = copy_record(base + off, klen, vlen, dst, &c);
        Py_END_ALLOW_THREADS
    } else {
        bad = copy_record(base + off, klen, vlen, dst, &c);
    }
    return bad;
}

/* The value for ``key`` at ``off`` of ``base`` as a new bytes; None (a new reference) when it
   does not read back (see copy_value); NULL on an error. */
static PyObject *take(const uint8_t *base, long long limit, long long off, PyObject *key, long long vlen) {
    Py_ssize_t klen;
    const char *kb = PyUnicode_AsUTF8AndSize(key, &klen);
    if (kb == NULL) return NULL;
    if (off < 0 || vlen < 0 || off + HDR + klen + vlen > limit) Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)vlen);
    if (out == NULL) return NULL;
    if (copy_value(base, limit, off, kb, klen, vlen, (unsigned char *)PyBytes_AS_STRING(out)) != 0) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

/* read(mm, fd, limit, off, key, vlen) -> bytes | None; see recread.py. */
static PyObject *read_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || CRC == NULL) {
        PyErr_SetString(PyExc_TypeError, "read(mm, fd, limit, off, key, vlen), after set_crc");
        return NULL;
    }
    if (args[0] == Py_None) Py_RETURN_NONE;  /* a segment that could not be mapped */
    long long fd = PyLong_AsLongLong(args[1]), limit = PyLong_AsLongLong(args[2]);
    long long off = PyLong_AsLongLong(args[3]), vlen = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer b;
    if (open_mapping(args[0], fd, &limit, &b) < 0) return NULL;
    PyObject *out = take((const uint8_t *)b.buf, limit, off, args[4], vlen);
    PyBuffer_Release(&b);
    return out;
}

/* read_into(mm, fd, limit, off, key, vlen, out) -> bool: read's checks, the value copied into
   the writable buffer ``out`` (ValueError when it is smaller than vlen) and its CRC checked
   there; False (``out`` may then hold damaged bytes) where read gives None. */
static PyObject *read_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || CRC == NULL) {
        PyErr_SetString(PyExc_TypeError, "read_into(mm, fd, limit, off, key, vlen, out), after set_crc");
        return NULL;
    }
    if (args[0] == Py_None) Py_RETURN_FALSE;
    long long fd = PyLong_AsLongLong(args[1]), limit = PyLong_AsLongLong(args[2]);
    long long off = PyLong_AsLongLong(args[3]), vlen = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t klen;
    const char *kb = PyUnicode_AsUTF8AndSize(args[4], &klen);
    if (kb == NULL) return NULL;
    Py_buffer o, b;
    if (PyObject_GetBuffer(args[6], &o, PyBUF_WRITABLE) < 0) return NULL;
    if (o.len < vlen) {
        PyBuffer_Release(&o);
        PyErr_SetString(PyExc_ValueError, "out is smaller than the value");
        return NULL;
    }
    if (open_mapping(args[0], fd, &limit, &b) < 0) {
        PyBuffer_Release(&o);
        return NULL;
    }
    int bad = copy_value((const uint8_t *)b.buf, limit, off, kb, klen, vlen, (unsigned char *)o.buf);
    PyBuffer_Release(&b);
    PyBuffer_Release(&o);
    return PyBool_FromLong(bad == 0);
}

/* read_run(mm, fd, limit, todo, i, out) -> (next i, hits, bytes, [keys that failed]): the
   records todo[i:] of one segment (todo: [(position, key, (segment id, offset, size, value
   length))], in file order; it stops at the first of another segment), each value read as
   read() reads it, stored at out[position]. */
static PyObject *read_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || CRC == NULL || !PyList_CheckExact(args[3]) || !PyList_CheckExact(args[5])) {
        PyErr_SetString(PyExc_TypeError, "read_run(mm, fd, limit, todo: list, i, out: list), after set_crc");
        return NULL;
    }
    long long fd = PyLong_AsLongLong(args[1]), limit = PyLong_AsLongLong(args[2]);
    Py_ssize_t i = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    PyObject *todo = args[3], *out = args[5], *bad = PyList_New(0);
    if (bad == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(todo);
    long long hits = 0, nbytes = 0, sid = -1;
    int mapped = args[0] != Py_None;
    Py_buffer b;
    if (mapped && open_mapping(args[0], fd, &limit, &b) < 0) {
        Py_DECREF(bad);
        return NULL;
    }
    for (; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(todo, i), *loc;
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 3 || !PyTuple_CheckExact(loc = PyTuple_GET_ITEM(item, 2))
            || PyTuple_GET_SIZE(loc) != 4) {
            PyErr_SetString(PyExc_TypeError, "todo items are (position, key, (sid, off, size, vlen))");
            goto fail;
        }
        long long s = PyLong_AsLongLong(PyTuple_GET_ITEM(loc, 0));
        if (sid == -1) sid = s;
        else if (s != sid) break;
        PyObject *key = PyTuple_GET_ITEM(item, 1);
        long long off = PyLong_AsLongLong(PyTuple_GET_ITEM(loc, 1)), vlen = PyLong_AsLongLong(PyTuple_GET_ITEM(loc, 3));
        Py_ssize_t p = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 0));
        if (PyErr_Occurred()) goto fail;
        if (p < 0 || p >= PyList_GET_SIZE(out)) {
            PyErr_SetString(PyExc_IndexError, "position outside out");
            goto fail;
        }
        PyObject *v = mapped ? take((const uint8_t *)b.buf, limit, off, key, vlen) : (Py_INCREF(Py_None), Py_None);
        if (v == NULL) goto fail;
        if (v == Py_None) {
            Py_DECREF(v);
            if (PyList_Append(bad, key) < 0) goto fail;
        } else {
            PyObject *old = PyList_GET_ITEM(out, p);
            PyList_SET_ITEM(out, p, v);
            Py_XDECREF(old);
            hits++;
            nbytes += vlen;
        }
    }
    if (mapped) PyBuffer_Release(&b);
    return Py_BuildValue("(nLLN)", i, hits, nbytes, bad);
fail:
    if (mapped) PyBuffer_Release(&b);
    Py_DECREF(bad);
    return NULL;
}

static PyObject *PASS = NULL, *S_MM = NULL, *S_SIZE = NULL, *S_RFD = NULL;

/* get(hot, segs, key) -> bytes | None | PASS: DiskTier.get's look-up and read in one call where
   it is the common case (``key`` in the index's dict ``hot``, its segment in ``segs`` mapped):
   the value, or None when the record does not read back; PASS for anything else, which the
   caller's Python path then handles as it would have. */
static PyObject *get_mapped(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || CRC == NULL || !PyDict_CheckExact(args[0]) || !PyDict_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "get(hot: dict, segs: dict, key), after set_crc");
        return NULL;
    }
    PyObject *loc = PyDict_GetItemWithError(args[0], args[2]);
    if (loc == NULL || !PyTuple_CheckExact(loc) || PyTuple_GET_SIZE(loc) != 4) {
        if (PyErr_Occurred()) return NULL;
        Py_INCREF(PASS);
        return PASS;
    }
    PyObject *seg = PyDict_GetItemWithError(args[1], PyTuple_GET_ITEM(loc, 0));
    if (seg == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_INCREF(PASS);
        return PASS;
    }
    Py_INCREF(seg);  /* (its attributes are read through calls that may run Python) */
    PyObject *mm = PyObject_GetAttr(seg, S_MM), *size = NULL, *rfd = NULL, *out = NULL;
    if (mm == NULL) goto done;
    if (mm == Py_None) {  /* not mapped now: the caller maps it */
        Py_INCREF(PASS);
        out = PASS;
        goto done;
    }
    if ((size = PyObject_GetAttr(seg, S_SIZE)) == NULL || (rfd = PyObject_GetAttr(seg, S_RFD)) == NULL) goto done;
    long long limit = PyLong_AsLongLong(size), fd = PyLong_AsLongLong(rfd);
    long long off = PyLong_AsLongLong(PyTuple_GET_ITEM(loc, 1)), vlen = PyLong_AsLongLong(PyTuple_GET_ITEM(loc, 3));
    if (PyErr_Occurred()) goto done;
    Py_buffer b;
    if (open_mapping(mm, fd, &limit, &b) < 0) goto done;
    out = take((const uint8_t *)b.buf, limit, off, args[2], vlen);
    PyBuffer_Release(&b);
done:
    Py_XDECREF(rfd);
    Py_XDECREF(size);
    Py_XDECREF(mm);
    Py_DECREF(seg);
    return out;
}

static PyMethodDef methods[] = {
    {"set_crc", (PyCFunction)set_crc, METH_O, "install crc32(seed, buf, len) by address"},
    {"install_guard", (PyCFunction)install_guard, METH_NOARGS, "install the SIGBUS guard"},
    {"guarded", (PyCFunction)is_guarded, METH_NOARGS, "whether the SIGBUS guard is installed"},
    {"crc", (PyCFunction)(void (*)(void))crc, METH_FASTCALL, "crc(data, seed)"},
    {"read", (PyCFunction)(void (*)(void))read_record, METH_FASTCALL, "read(mm, fd, limit, off, key, vlen)"},
    {"get", (PyCFunction)(void (*)(void))get_mapped, METH_FASTCALL, "get(hot, segs, key)"},
    {"read_run", (PyCFunction)(void (*)(void))read_run, METH_FASTCALL,
     "read_run(mm, fd, limit, todo, i, out)"},
    {"read_into", (PyCFunction)(void (*)(void))read_into, METH_FASTCALL,
     "read_into(mm, fd, limit, off, key, vlen, out)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier_recread", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvtier_recread(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PASS == NULL) {
        PASS = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
        S_MM = PyUnicode_InternFromString("mm");
        S_SIZE = PyUnicode_InternFromString("size");
        S_RFD = PyUnicode_InternFromString("rfd");
        if (PASS == NULL || S_MM == NULL || S_SIZE == NULL || S_RFD == NULL) {
            Py_DECREF(m);
            return NULL;
        }
    }
    Py_INCREF(PASS);
    if (PyModule_AddObject(m, "PASS", PASS) < 0) {
        Py_DECREF(PASS);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
""".replace("MAGIC", f"{REC_MAGIC:#x}u").replace("HDR", str(REC_HEADER_BYTES)) \
   .replace("RELEASE", str(_RELEASE_BYTES))

_FLAGS = ["-O2", "-fPIC", "-shared", "-std=gnu11"]


def _isal_crc_address() -> int:
    """The address of ISA-L's ``crc32_gzip_refl(seed, buf, len)``, the function
    ``kvtier._crc.crc32`` runs (OSError where that is not ISA-L's)."""
    if IMPLEMENTATION != "isal":
        raise OSError("ISA-L is not installed: reads keep zlib's CRC in Python")
    from isal import isal_zlib

    fn = ctypes.CDLL(isal_zlib.__file__).crc32_gzip_refl
    return ctypes.cast(fn, ctypes.c_void_p).value


def _declare(mod) -> None:
    """Install the CRC and check that the module computes what the Python path does."""
    mod.set_crc(_isal_crc_address())
    probe = bytes(range(256)) * 41
    if any(mod.crc(probe, seed) != crc32(probe, seed) for seed in (0, 7, 0xFFFFFFFF)):
        raise OSError("the compiled CRC does not match kvtier._crc")


_EXT = CExtension("recread", _SRC, _FLAGS, _declare, "L3 reads parse records in Python")


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
    if mod is not None and not mod.guarded():
        try:
            mod.install_guard()
        except OSError:  # reads probe the file's size instead
            pass
    return mod


def guarded() -> bool:
    """Whether reads through :func:`load`'s module catch a SIGBUS instead of probing the file's size."""
    mod = _EXT.load()
    return mod is not None and mod.guarded()
