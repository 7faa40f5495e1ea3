/* One L3 record read as a CPython extension (module kvtier_record_read), wrapped by
   kvtier/tiers/disk/record_read.py, which documents each function, the GIL and the SIGBUS guard.
   Built on first use by kvtier/_clib.py against this interpreter's headers; the wrapper's
   flags define, from its Python constants:
     KVT_REC_MAGIC      a record header's magic (segment.REC_MAGIC)
     KVT_REC_HDR        a record header's bytes (segment.REC_HEADER_BYTES)
     KVT_RELEASE_BYTES  values larger than this are copied with the GIL let go of */
#if !defined(KVT_REC_MAGIC) || !defined(KVT_REC_HDR) || !defined(KVT_RELEASE_BYTES)
#error "built by kvtier/tiers/disk/record_read.py, which defines KVT_REC_MAGIC, KVT_REC_HDR and KVT_RELEASE_BYTES"
#endif
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

static void on_sigbus(int Py_UNUSED(sig), siginfo_t *Py_UNUSED(info), void *Py_UNUSED(ctx)) {
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

/* Whether the handler in place is on_sigbus: a library loaded later may have put its own there
   (glog's failure handler, faulthandler.enable()), and then a guarded read would die. */
static int handler_is_ours(void) {
    struct sigaction cur;
    if (sigaction(SIGBUS, NULL, &cur) != 0) return 0;
    return (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus;
}

static PyObject *is_guarded(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(unused)) {
    if (guarded && !handler_is_ours()) guarded = 0;  /* reads probe the size until reinstalled */
    return PyBool_FromLong(guarded);
}

/* Install the guard, or put it back where another handler replaced it (that one becomes the
   handler faults outside a guarded access go to). */
static PyObject *install_guard(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(unused)) {
    if (!guarded || !handler_is_ours()) {
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
    int bad = magic != KVT_REC_MAGIC || kl != klen || vl != vlen;
    if (!bad) memcpy(dst, h + KVT_REC_HDR + klen, (size_t)vlen);
    guard = NULL;
    if (!bad) bad = CRC(*crc, dst, (uint64_t)vlen) != dcrc;
    return bad;
}

static PyObject *set_crc(PyObject *Py_UNUSED(self), PyObject *arg) {
    unsigned long long a = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    CRC = (crc_fn)(uintptr_t)a;
    Py_RETURN_NONE;
}

/* crc(data, seed): the CRC-32 of a buffer through the function set_crc installed. */
static PyObject *crc(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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
    if (off < 0 || vlen < 0 || off + KVT_REC_HDR + klen + vlen > limit) return 1;
    uint32_t c = CRC(0, (const unsigned char *)kb, (uint64_t)klen);
    int bad;
    if (vlen > KVT_RELEASE_BYTES) {
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
    if (off < 0 || vlen < 0 || off + KVT_REC_HDR + klen + vlen > limit) Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)vlen);
    if (out == NULL) return NULL;
    if (copy_value(base, limit, off, kb, klen, vlen, (unsigned char *)PyBytes_AS_STRING(out)) != 0) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

/* read(mm, fd, limit, off, key, vlen) -> bytes | None; see record_read.py. */
static PyObject *read_record(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *read_into(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *read_run(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *get_mapped(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "kvtier_record_read", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit_kvtier_record_read(void) {
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
