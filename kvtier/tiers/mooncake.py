"""L4 on Mooncake Store: a distributed pool of DRAM that a ``mooncake_master`` indexes and
store servers (``mooncake_client``, or clients that contribute a segment) hold.

URL::

    mooncake://HOST:RPC_PORT?metadata=http://HOST:PORT/metadata[&admin=http://HOST:PORT]
        [&segment_bytes=N][&buffer_bytes=N][&protocol=tcp][&local_hostname=IP]

- ``metadata``: the transfer engine's metadata server (the master's own with
  ``-enable_http_metadata_server=true``).
- ``admin``: the master's HTTP admin port (``-metrics_port``, 9003 by default), which lists keys
  and segments; default ``http://HOST:9003``.
- ``segment_bytes``: DRAM this process lends to the pool (0, the default: none; records then live
  on store servers and outlive this process). A lent segment leaves the pool with its process, and
  the records in it with it. Sizes take ``KiB``/``MiB``/``GiB`` suffixes.
- ``buffer_bytes``: the client's transfer buffer and this tier's staging buffer, each (64 MiB):
  the largest value is this less the frame.
- ``local_hostname``: the address other nodes reach this one at (default: the address this host
  routes to the master from).

Values are framed like Redis' (``remote.py``: magic, version, length, CRC32 of key + payload), so
a damaged, truncated or foreign value is a miss. Writes are zero-copy batched: frames are assembled
in a staging buffer registered with the transfer engine and sent with ``batch_upsert_from``; reads
land with ``batch_get_into`` in the other half of it, are CRC-checked there and copied out once.

Failure model, as Redis': the pool is an optimisation, never a dependency. A master that cannot be
reached (RPC failure, refused connection) turns every call into a miss / ``False`` with one
logged warning per outage; while it lasts, calls return at once and the master is probed (a TCP
connect bounded by ``probe_timeout_s``) with a backoff from ``retry_interval_s`` doubling up to 8x.
The client connects (``setup``) on a thread of its own, so a master that hangs its first answer
delays at most one call by ``connect_wait_s``. A full pool, a record evicted by the master or
lost with the store server that held it is a miss; a put the pool has no room for is ``False``.

Accounting: ``keys()``, ``used_bytes`` and ``len`` read the master's key listing (admin port), so
every process sees the same figures, evictions included. ``capacity_bytes`` is a namespace quota
if one is given, else the pool's total segment bytes. The quota is checked against the namespace's
bytes as last listed (re-listed at most every ``_USED_TTL_S``) plus this client's puts since:
exact for one writer, approximate under several (each may overshoot by what the others put in
between), unlike Redis' atomic counter.

Ownership: ``put`` copies (into the staging buffer); ``get`` returns bytes of its own.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from urllib.parse import quote

import numpy as np
import torch

from .base import BytesLike, Tier, as_byte_view, check_key, out_view
from .reach import Reachable, check_seconds, check_window
from .mooncake_client import _shared_client
from .mooncake_url import MIN_BUFFER_BYTES, MooncakeURL, check_url
from .remote import HEADER_BYTES, check_key_prefix, check_quota, frame_header, unframe

log = logging.getLogger(__name__)

# Mooncake's error codes (mooncake-store/include/types.h) this tier tells apart.
NO_SPACE = -200          # NO_AVAILABLE_HANDLE: the pool has no room (or no segment at all)
BUFFER_TOO_SMALL = -600  # INVALID_PARAMS from batch_get_into: the value is larger than its slot
NOT_FOUND = -704         # OBJECT_NOT_FOUND
RPC_FAIL = -900          # and below: the master (or the metadata/HA service) could not be reached

_USED_TTL_S = 1.0        # how old the namespace's listed bytes may be for a quota decision
_INFO_TTL_S = 10.0       # how old the pool's segment figures may be
_FIRST_SLOT = 64 << 10   # read slot per key before any value size was seen
_QUERY_KEYS = 256        # keys per size query to the admin port (URL length)



class MooncakeTier(Reachable, Tier):
    """Key -> bytes in a Mooncake Store pool, shared by every process using the same master and prefix.

    Args:
        url: ``mooncake://HOST:RPC_PORT?metadata=...`` (module docstring).
        key_prefix: namespace of this tier's keys in the pool.
        retry_interval_s: while the master is unreachable, the least time before the first probe
            (later probes back off, doubling up to 8x).
        probe_timeout_s: bound on one probe of the master's RPC port.
        connect_wait_s: how long the first call waits for the client's setup.
        capacity_bytes: quota of this namespace (puts beyond it return False); None: no quota, the
            pool's segments are the capacity and the master evicts when they fill.
        latency_window: round trips kept for the latency percentiles.

    Nothing is sent at construction: an unreachable master is found out on first use.
    """

    name = "remote"

    def __init__(self, url: str, *, key_prefix: str = "kvtier:", retry_interval_s: float = 1.0,
                 probe_timeout_s: float = 0.25, connect_wait_s: float = 5.0,
                 capacity_bytes: int | None = None, latency_window: int = 4096) -> None:
        self.cfg = MooncakeURL(url)
        self.url = url
        check_key_prefix(key_prefix)
        retry_interval_s = check_seconds("retry_interval_s", retry_interval_s, allow_zero=True)
        self.probe_timeout_s = check_seconds("probe_timeout_s", probe_timeout_s, allow_zero=False)
        self.connect_wait_s = check_seconds("connect_wait_s", connect_wait_s, allow_zero=True)
        check_quota(capacity_bytes)
        check_window(latency_window)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:  # an optional dependency: only this L4 needs it
            raise ImportError("MooncakeTier needs the Mooncake client: pip install 'kvtier[mooncake]' "
                              "(and the libibverbs1/librdmacm1 system packages, even for TCP)") from e
        del MooncakeDistributedStore  # loaded here so that a missing wheel fails at construction
        # probes back off to 8x the interval: a master that stays away costs ever fewer connects
        self._start(f"MooncakeTier {self.cfg.master}", url, key_prefix, capacity_bytes, retry_interval_s, 8.0,
                    latency_window, log)
        # Largest framed value: one half of the staging buffer (puts in one, gets in the other).
        self._half = self.cfg.buffer_bytes // 2
        self.max_value_bytes = self._half - HEADER_BYTES

        # Lock order: _put_lock or _get_lock (one staging half each), then _setup_lock (the staging
        # buffer's registration), then _lock (counters, state).
        self._setup_lock = threading.Lock()
        self._put_lock = threading.Lock()
        self._get_lock = threading.Lock()
        self._store = None                     # the process's client, once set up, this tier's buffer registered
        self._staging: np.ndarray | None = None  # [put half | get half], registered with the client
        self._slot = _FIRST_SLOT               # read slot per key: the largest frame seen so far
        self._used: int | None = None          # namespace bytes for quota decisions
        self._used_at = -1e9
        self._pending_used = 0                 # what _used becomes if a quota-checked batch lands whole
        self._pool: dict = {}
        self._pool_at = -1e9

    # -- connection ------------------------------------------------------------------------------

    def _probe(self) -> bool:
        try:
            with socket.create_connection((self.cfg.host, self.cfg.rpc_port), timeout=self.probe_timeout_s):
                return True
        except OSError:
            return False

    def _client(self, n_keys: int):
        """The connected client, or None (counted as ``n_keys`` skipped) while the master is
        down, being probed, or the client is still connecting."""
        self._check_open()
        reach = self._reach
        if self._store is not None and reach.connected:
            return self._store
        if reach.skip(n_keys):
            return None
        shared = _shared_client(self.cfg)
        store = shared.store
        # Probe before calling the client: while the master is away, its calls block for seconds
        # (it reconnects), and a setup for minutes.
        if (store is None and not shared.connecting or not reach.connected) and not self._probe():
            reach.went_down(f"no answer on {self.cfg.master}")
            reach.count_skipped(n_keys)
            return None
        if store is None:
            shared.start(self.connect_wait_s)
            store = shared.wait()
            if store is None:
                if shared.rc is not None and not shared.connecting:
                    reach.went_down(f"client setup returned {shared.rc}")
                reach.count_skipped(n_keys)
                return None
        with self._setup_lock:  # one staging buffer per tier, registered once
            if self._staging is None:
                staging = np.zeros(2 * self._half, dtype=np.uint8)
                rc = store.register_buffer(staging.ctypes.data, staging.nbytes)
                if rc != 0:
                    reach.went_down(f"register_buffer returned {rc}")
                    reach.count_skipped(n_keys)
                    return None
                with self._lock:
                    if self._closed:  # closed meanwhile by another thread
                        store.unregister_buffer(staging.ctypes.data)
                        self._check_open()
                    self._staging = staging
            self._store = store
        return store

    def _result(self, codes: list[int], t0: float) -> bool:
        """Record a round trip's outcome; False (and the outage noted) when the master failed it."""
        if any(c <= RPC_FAIL for c in codes):
            self._reach.went_down(f"RPC error {min(codes)}")
            return False
        self._reach.came_up(time.perf_counter() - t0)
        return True

    # -- the master's admin port -----------------------------------------------------------------

    def _admin(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(self.cfg.admin + path, timeout=max(self.probe_timeout_s, 1.0)) as r:
                return r.read()
        except (OSError, urllib.error.URLError, ValueError) as e:
            self._reach.warn_limited("MooncakeTier: admin port %s did not answer %s (%s); listings are empty",
                                     self.cfg.admin, path, e)
            return None

    def _namespace_keys(self) -> list[str]:
        raw = self._admin("/get_all_keys")
        if raw is None:
            return []
        p = self.key_prefix
        return sorted({k[len(p):] for k in raw.decode("utf-8", "replace").split("\n") if k.startswith(p) and k != p})

    def _sizes(self, store, skeys: list[str]) -> list[int]:
        """Stored (framed) size of each server key; 0 where absent. Asked of the admin port in
        batches (one HTTP request for hundreds of keys), of the client (one RPC each) for what
        that did not answer."""
        sizes: dict[str, int] = {}
        for i in range(0, len(skeys), _QUERY_KEYS):
            part = skeys[i:i + _QUERY_KEYS]
            raw = self._admin("/batch_query_keys?keys=" + ",".join(quote(k, safe="") for k in part))
            try:
                data = json.loads(raw)["data"] if raw is not None else {}
                for k in part:
                    d = data.get(k)
                    if isinstance(d, dict):
                        sizes[k] = int(d["values"][0]["size_"]) if d.get("ok") and d.get("values") else 0
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                pass
        return [sizes[k] if k in sizes else max(store.get_size(k), 0) for k in skeys]

    def _listed_bytes(self) -> int | None:
        store = self._client(1)
        if store is None:
            return None
        keys = self._namespace_keys()
        total = sum(self._sizes(store, [self.key_prefix + k for k in keys]))
        with self._lock:
            self._used, self._used_at = total, time.monotonic()
        return total

    def _pool_info(self) -> dict:
        if self.connected and time.monotonic() - self._pool_at > _INFO_TTL_S:
            raw = self._admin("/get_segments_detail")
            if raw is not None:
                try:
                    segs = json.loads(raw).get("segments", [])
                    self._pool = {"pool_bytes": sum(int(s.get("size_bytes", 0)) for s in segs),
                                  "pool_used_bytes": sum(int(s.get("allocator_used_bytes", 0)) for s in segs),
                                  "pool_segments": len(segs)}
                    self._pool_at = time.monotonic()
                except (ValueError, AttributeError, TypeError):
                    pass
        return self._pool

    # -- the Tier interface ----------------------------------------------------------------------

    def _skey(self, key: str) -> str:
        return self.key_prefix + check_key(key)

    @property
    def capacity_bytes(self) -> int:
        """The namespace quota if one was given; else the pool's total segment bytes (0 while
        the master's admin port has never answered)."""
        if self._quota is not None:
            return self._quota
        return int(self._pool_info().get("pool_bytes", 0))

    @property
    def used_bytes(self) -> int:
        """Bytes of this namespace's records in the pool, frames included, as the master lists
        them (last known value while it is unreachable)."""
        self._check_open()
        got = self._listed_bytes()
        return got if got is not None else (self._used or 0)

    def _check_values(self, items: list[tuple[str, BytesLike]]) -> list[tuple[str, str, memoryview]]:
        limit = self.max_value_bytes
        if self._quota is not None:
            limit = min(limit, self._quota - HEADER_BYTES)
        out = []
        for key, value in items:
            skey = self._skey(key)
            mv = as_byte_view(value)
            if mv.nbytes > limit:
                raise ValueError(f"value of {mv.nbytes} bytes exceeds what MooncakeTier can hold ({max(limit, 0)} "
                                 f"bytes: capacity_bytes, or half of buffer_bytes, less the {HEADER_BYTES}-byte frame)")
            out.append((key, skey, mv))
        return out

    def put(self, key: str, value: BytesLike) -> bool:
        return self.put_many([(key, value)])[0]

    def put_many(self, items: Iterable[tuple[str, BytesLike]]) -> list[bool]:
        """Store every item (batches of ``batch_upsert_from`` from the staging buffer); False
        where it did not fit the quota or the pool, or the master was unreachable."""
        self._check_open()
        checked = self._check_values(list(items))
        n = len(checked)
        if not n:
            return []
        ok = [False] * n
        store = self._client(n)
        if store is not None:
            with self._put_lock:
                admit = self._admit(store, checked)
                todo = [i for i in range(n) if admit[i]]
                start = 0
                while start < len(todo):
                    # as many frames as fit the put half of the staging buffer, no key twice (the
                    # client's batch does not say which of two puts of a key lands last)
                    end, nbytes, keys_in = start, 0, set()
                    while end < len(todo) and nbytes + HEADER_BYTES + checked[todo[end]][2].nbytes <= self._half \
                            and checked[todo[end]][1] not in keys_in:
                        nbytes += HEADER_BYTES + checked[todo[end]][2].nbytes
                        keys_in.add(checked[todo[end]][1])
                        end += 1
                    part = todo[start:end]
                    codes = self._upsert(store, [checked[i] for i in part])
                    if codes is None:
                        break
                    for i, c in zip(part, codes):
                        ok[i] = c == 0
                    if NO_SPACE in codes:
                        self._reach.warn_limited("MooncakeTier %s: the pool had no room for %d value(s) (no store server, "
                                           "or every segment full of leased objects)", self.cfg.master,
                                           codes.count(NO_SPACE))
                    start = end
                self._settle_quota(checked, admit, ok)
        framed = [HEADER_BYTES + mv.nbytes for _, _, mv in checked]
        with self._lock:
            self._stats.puts += n
            self._stats.bytes_in += sum(f - HEADER_BYTES for f, good in zip(framed, ok) if good)
            self._rejected += ok.count(False)
            self._slot = max(self._slot, max(framed))
        return ok

    def _upsert(self, store, part: list[tuple[str, str, memoryview]]) -> list[int] | None:
        buf = self._staging
        base = buf.ctypes.data
        ptrs, sizes, off = [], [], 0
        for key, _skey, mv in part:
            hdr = frame_header(key, mv)
            buf[off:off + HEADER_BYTES] = np.frombuffer(hdr, dtype=np.uint8)
            if mv.nbytes:
                buf[off + HEADER_BYTES:off + HEADER_BYTES + mv.nbytes] = np.frombuffer(mv, dtype=np.uint8)
            ptrs.append(base + off)
            sizes.append(HEADER_BYTES + mv.nbytes)
            off += sizes[-1]
        t0 = time.perf_counter()
        codes = list(store.batch_upsert_from([s for _, s, _ in part], ptrs, sizes))
        return codes if self._result(codes, t0) else None

    def _admit(self, store, checked: list[tuple[str, str, memoryview]]) -> list[bool]:
        """Which items the quota lets in, in order (all of them without a quota)."""
        if self._quota is None:
            return [True] * len(checked)
        with self._lock:
            fresh = time.monotonic() - self._used_at <= _USED_TTL_S and self._used is not None
        if not fresh:
            self._listed_bytes()
        old = dict(zip((s for _, s, _ in checked), self._sizes(store, [s for _, s, _ in checked])))
        with self._lock:
            used = self._used or 0
            out = []
            for _key, skey, mv in checked:
                new = HEADER_BYTES + mv.nbytes
                fits = used - old[skey] + new <= self._quota
                if fits:
                    used += new - old[skey]
                    old[skey] = new
                out.append(fits)
            self._pending_used = used
        return out

    def _settle_quota(self, checked, admit, ok) -> None:
        """After a quota-checked batch: the namespace bytes assumed for it stand if every admitted
        put landed; otherwise they are listed again on the next decision."""
        if self._quota is None:
            return
        with self._lock:
            if all(o for o, a in zip(ok, admit) if a):
                self._used = self._pending_used
            else:
                self._used_at = -1e9

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        """Fetch every key (``batch_get_into`` the staging buffer, a slot per key); None where
        absent, evicted, corrupt, foreign or unreachable."""
        self._check_open()
        keys = list(keys)
        skeys = [self._skey(k) for k in keys]
        n = len(keys)
        if not n:
            return []
        out: list[bytes | None] = [None] * n
        seen = [False] * n  # a value came back (whether or not its frame checked out)
        store = self._client(n)
        if store is not None:
            # each key read once (a key twice in one batch_get_into reads torn bytes)
            first = {}
            for i, sk in enumerate(skeys):
                first.setdefault(sk, i)
            with self._get_lock:
                self._read(store, keys, skeys, list(first.values()), out, seen)
            for i, sk in enumerate(skeys):
                j = first[sk]
                out[i], seen[i] = out[j], seen[j]
        bad = [k for k, s, o in zip(keys, seen, out) if s and o is None]
        self._count_gets(out, seen)
        if bad:
            log.warning("MooncakeTier %s: %d value(s) failed their frame/CRC check (first: %r); treated as misses",
                        self.cfg.master, len(bad), bad[0])
        return out

    def _read(self, store, keys, skeys, idx: list[int], out, seen) -> None:
        buf = self._staging
        base = buf.ctypes.data + self._half
        slot = min(self._slot, self._half)
        retry: list[int] = []
        per = max(1, self._half // slot)
        for c0 in range(0, len(idx), per):
            part = idx[c0:c0 + per]
            t0 = time.perf_counter()
            codes = list(store.batch_get_into([skeys[i] for i in part], [base + j * slot for j in range(len(part))],
                                              [slot] * len(part)))
            if not self._result(codes, t0):
                return
            for j, (i, c) in enumerate(zip(part, codes)):
                if c == BUFFER_TOO_SMALL:
                    retry.append(i)
                elif c >= 0:
                    seen[i] = True
                    view = memoryview(buf)[self._half + j * slot:self._half + j * slot + c]
                    got = unframe(keys[i], view)
                    out[i] = None if got is None else bytes(got)
        for i in retry:  # larger than any value seen so far: once more with its own size
            size = store.get_size(skeys[i])
            if not HEADER_BYTES <= size <= self._half:
                continue
            with self._lock:
                self._slot = max(self._slot, size)
            t0 = time.perf_counter()
            codes = list(store.batch_get_into([skeys[i]], [base], [size]))
            if not self._result(codes, t0):
                return
            if codes[0] >= 0:
                seen[i] = True
                got = unframe(keys[i], memoryview(buf)[self._half:self._half + codes[0]])
                out[i] = None if got is None else bytes(got)

    def get_into(self, key: str, out) -> int | None:
        """Copy the value into ``out``; None when absent. ``out`` is checked before anything is
        counted, so a refused call (too small, read-only) leaves hits/misses unchanged."""
        out_view(out, 0)
        self._check_open()
        skey = self._skey(key)
        got: bytes | None = None
        seen = [False]
        res: list[bytes | None] = [None]
        store = self._client(1)
        if store is not None:
            with self._get_lock:
                self._read(store, [key], [skey], [0], res, seen)
        got = res[0]
        if got is not None:
            mv, dev = out_view(out, len(got))
            if mv is not None:
                mv[:len(got)] = got
            elif got:
                dev[:len(got)].copy_(torch.frombuffer(bytearray(got), dtype=torch.uint8))
        self._count_gets(res, seen)
        return None if got is None else len(got)

    def _count_gets(self, values: list[bytes | None], seen: list[bool]) -> None:
        """Account reads: a value that came back but failed its frame/CRC check is a corrupt miss."""
        with self._lock:
            self._stats.gets += len(values)
            for got, came in zip(values, seen):
                if got is None:
                    self._stats.misses += 1
                    self._corrupt += came
                else:
                    self._stats.hits += 1
                    self._stats.bytes_out += len(got)

    def _begin(self, keys: Iterable[str]):
        """Server keys of ``keys`` (checked) and the client, None when there are none or no client."""
        self._check_open()
        skeys = [self._skey(k) for k in keys]
        return skeys, (self._client(len(skeys)) if skeys else None)

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        """Whether each key is in the pool, in one round trip (``batch_is_exist``). Presence only:
        a value that fails its frame/CRC check still reads as a miss. Nothing is counted."""
        skeys, store = self._begin(keys)
        if store is None:
            return [False] * len(skeys)
        t0 = time.perf_counter()
        codes = list(store.batch_is_exist(skeys))
        if not self._result(codes, t0):
            return [False] * len(skeys)
        return [c == 1 for c in codes]

    def value_size(self, key: str) -> int | None:
        """Length of the value under ``key`` from the master (not fetched, not CRC-checked);
        None when absent or the master is unreachable."""
        skey = self._skey(key)
        store = self._client(1)
        if store is None:
            return None
        t0 = time.perf_counter()
        n = store.get_size(skey)
        if n <= RPC_FAIL and not self._result([n], t0):
            return None
        return n - HEADER_BYTES if n >= HEADER_BYTES else None

    def delete(self, key: str) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Iterable[str]) -> list[bool]:
        """Remove every key in one round trip (``batch_remove``, leases overridden: a reader that
        raced the removal fails its CRC check); False where absent or the master was unreachable."""
        skeys, store = self._begin(keys)
        if store is None:
            return [False] * len(skeys)
        with self._put_lock:
            sizes = self._sizes(store, skeys) if self._quota is not None else None
            t0 = time.perf_counter()
            codes = list(store.batch_remove(skeys, True))
            if not self._result(codes, t0):
                return [False] * len(skeys)
            ok = [c == 0 for c in codes]
            if sizes is not None:
                with self._lock:
                    if self._used is not None:
                        self._used = max(0, self._used - sum(s for s, good in zip(sizes, ok) if good))
        return ok

    def keys(self) -> Iterator[str]:
        """This namespace's keys (a snapshot of the master's listing; nothing while it is unreachable)."""
        self._check_open()
        if self._client(1) is None:
            return iter([])
        return iter(self._namespace_keys())

    def stats(self) -> dict:
        """Tier counters plus: errors, skipped (keys not tried while the master was down), rejected
        (puts not stored), corrupt, outages, latency_p50_ms/latency_p99_ms per round trip,
        connected, and the pool's pool_bytes/pool_used_bytes/pool_segments."""
        self._check_open()
        reach = self._reach.stats()  # snapshot before this call's own round trips
        with self._lock:
            s = self._stats.as_dict()
            s.update(rejected=self._rejected, corrupt=self._corrupt)
        s.update(reach)
        keys = list(self.keys())
        s.update(used_bytes=self.used_bytes, capacity_bytes=self.capacity_bytes, records=len(keys),
                 connected=self.connected, **{k: int(v) for k, v in self._pool_info().items()})
        return s

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def close(self) -> None:
        """Unregister and free this tier's staging buffer; the process's client stays for other
        tiers of the same pool (and leaves the master at exit)."""
        if self._closed:
            return
        with self._put_lock, self._get_lock:  # no call of this tier is using the buffer now
            with self._lock:
                self._closed = True
                store, self._store = self._store, None
                staging, self._staging = self._staging, None
        if store is not None and staging is not None:
            store.unregister_buffer(staging.ctypes.data)

    def __repr__(self) -> str:
        return f"MooncakeTier({self.url!r}, key_prefix={self.key_prefix!r})"


__all__ = ["MooncakeTier", "MooncakeURL", "check_url", "MIN_BUFFER_BYTES"]
