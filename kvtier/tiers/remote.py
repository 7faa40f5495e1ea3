"""L4: a Redis/Valkey server shared by many processes and machines.

Every value travels in a small frame so that a corrupt, truncated or foreign value (another
program's, another key's) reads as a miss, never as wrong bytes:

```
 offset 0   4 bytes  magic b"KVL4"
        4   u16 LE   format version (1)
        6   u16 LE   flags (0)
        8   u32 LE   payload length
       12   u32 LE   CRC32 of (tier key UTF-8 + payload)
       16   payload
```
Server keys are ``key_prefix + key``. ``used_bytes`` is this namespace's bytes (frames included),
kept by the server in the counter ``key_prefix + "\\0used"`` and updated atomically by the
put/delete Lua scripts, so every process sharing the namespace sees the same figure. Records the
server evicts under its own ``maxmemory-policy`` are not subtracted until :meth:`resync`.
The server's own ``used_memory``/``maxmemory``/policy are reported by :meth:`stats`.

Failure model: the server is an optimisation, never a dependency. A lost connection (refused,
reset, timed out) turns every call into a miss / ``False`` with one logged warning per outage;
while it lasts the server is tried again at most every ``retry_interval_s`` seconds, and each try
is bounded by ``socket_timeout_s``. Server-side refusals (``OOM`` under ``noeviction``, a read-only
replica) make the affected puts return ``False``. Only bad arguments raise (``ValueError``), and
use after :meth:`close` (``TierClosedError``).

Ownership: ``put`` copies (the value is framed into new bytes before it is sent); ``get`` returns
a read-only memoryview over bytes received for that call alone.
Redis Cluster is not supported (the Lua scripts touch several keys); use one server or a proxy.
"""
from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterable, Iterator
from hashlib import sha1
from urllib.parse import urlsplit, urlunsplit

import torch

from kvtier._crc import crc32  # zlib's CRC-32, computed by ISA-L where installed

from .base import BytesLike, Tier, as_byte_view, check_key, out_view
from .reach import Reachable, check_seconds, check_window, split_url

log = logging.getLogger(__name__)

MAGIC = b"KVL4"
VERSION = 1
_FRAME = struct.Struct("<4sHHII")  # magic, version, flags, payload length, crc32(key + payload)
HEADER_BYTES = _FRAME.size
#: Redis refuses bulk strings over ``proto-max-bulk-len`` (512 MiB by default).
MAX_VALUE_BYTES = (512 << 20) - HEADER_BYTES
#: A batch is sent as one pipeline of script calls / MGETs of at most this many keys or bytes each,
#: so one huge batch does not stall other clients of the server for long.
_CHUNK_KEYS = 512
_CHUNK_BYTES = 32 << 20

_URL_FORM = "redis://[[user]:password@]host[:port][/db], rediss://... (TLS) or unix:///path/to.sock[?db=N]"

# KEYS[1] = namespace byte counter, KEYS[2..] = record keys; ARGV[1] = capacity (0: none),
# ARGV[2..] = framed values. Returns 1 (stored) / 0 (would exceed capacity) per key.
# Over maxmemory (noeviction) the server refuses a script at its first write, never half-way, so
# one call stores all of its batch or none of it and the counter stays exact.
_PUT_LUA = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local cap = tonumber(ARGV[1])
local out = {}
for i = 2, #KEYS do
  local old = redis.call('STRLEN', KEYS[i])
  local new = string.len(ARGV[i])
  if cap > 0 and used - old + new > cap then
    out[#out + 1] = 0
  else
    redis.call('SET', KEYS[i], ARGV[i])
    used = used - old + new
    out[#out + 1] = 1
  end
end
if used < 0 then used = 0 end
redis.call('SET', KEYS[1], used)
return out
"""

# KEYS[1] = namespace byte counter, KEYS[2..] = record keys. Returns 1 (deleted) / 0 per key.
_DEL_LUA = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local out = {}
for i = 2, #KEYS do
  local old = redis.call('STRLEN', KEYS[i])
  local n = redis.call('DEL', KEYS[i])
  if n > 0 then used = used - old end
  out[#out + 1] = n
end
if used < 0 then used = 0 end
redis.call('SET', KEYS[1], used)
return out
"""


def _bad_url(url: object, why: str) -> ValueError:
    return ValueError(f"url must look like {_URL_FORM}; {why}: {_redact(url)!r}")


def _redact(url: object) -> object:
    if not isinstance(url, str):
        return url
    try:
        u = urlsplit(url)
        if u.password:
            netloc = u.netloc.replace(":" + u.password + "@", ":***@")
            return urlunsplit(u._replace(netloc=netloc))
    except ValueError:
        pass
    return url


def check_url(url: object) -> str:
    """Validate a server URL (see ``_URL_FORM``); returns it unchanged. Raises ValueError naming ``url``."""
    u, port = split_url(url, _bad_url)
    if u.scheme in ("redis", "rediss"):
        if not u.hostname:
            raise _bad_url(url, "no host")
        if port is not None and not 0 < port < 65536:
            raise _bad_url(url, "port out of range")
        db = u.path.lstrip("/")
        if db and not db.isdigit():
            raise _bad_url(url, "db must be a non-negative integer")
    elif u.scheme == "unix":
        if not u.path:
            raise _bad_url(url, "no socket path")
    else:
        raise _bad_url(url, f"unsupported scheme {u.scheme!r}")
    return url


def check_key_prefix(key_prefix: object) -> str:
    """A namespace on a shared server: a str of at most 128 UTF-8 bytes without NUL."""
    if not isinstance(key_prefix, str) or "\x00" in key_prefix or len(key_prefix.encode()) > 128:
        raise ValueError(f"key_prefix must be a str of at most 128 UTF-8 bytes without NUL; got {key_prefix!r:.80}")
    return key_prefix


def check_quota(capacity_bytes: object) -> int | None:
    if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int)
                                       or capacity_bytes < 1):
        raise ValueError(f"capacity_bytes must be an int >= 1 or None; got {capacity_bytes!r}")
    return capacity_bytes


def frame_header(key: str, value: memoryview) -> bytes:
    """The ``HEADER_BYTES`` that precede ``value`` stored under ``key`` (its CRC included); a
    tier that assembles frames in a buffer of its own writes these, then the value."""
    crc = crc32(value, crc32(key.encode("utf-8")))
    return _FRAME.pack(MAGIC, VERSION, 0, value.nbytes, crc)


def frame(key: str, value: memoryview) -> bytes:
    """Frame ``value`` for storage under ``key`` (owned bytes)."""
    return b"".join((frame_header(key, value), value))


def unframe(key: str, raw: bytes | memoryview | None) -> memoryview | None:
    """The payload of a framed value (a view into ``raw``), or None when absent, not ours, or damaged."""
    if raw is None or len(raw) < HEADER_BYTES:
        return None
    magic, version, _flags, n, crc = _FRAME.unpack_from(raw, 0)
    if magic != MAGIC or version != VERSION or n != len(raw) - HEADER_BYTES:
        return None
    payload = memoryview(raw)[HEADER_BYTES:]
    if crc32(payload, crc32(key.encode("utf-8"))) != crc:
        return None
    return payload


def _chunks(n_items: int, sizes: list[int] | None = None) -> Iterator[slice]:
    start, nbytes = 0, 0
    for i in range(n_items):
        nbytes += sizes[i] if sizes else 0
        if i + 1 - start >= _CHUNK_KEYS or nbytes >= _CHUNK_BYTES:
            yield slice(start, i + 1)
            start, nbytes = i + 1, 0
    if start < n_items:
        yield slice(start, n_items)


class RemoteTier(Reachable, Tier):
    """Key -> bytes on a Redis/Valkey server, shared by every process using the same URL and prefix.

    Args:
        url: ``redis://host:port/db`` (also ``rediss://`` and ``unix:///path.sock?db=N``).
        key_prefix: namespace of this tier's keys on the server.
        socket_timeout_s: bound on connecting and on each round trip.
        retry_interval_s: while the server is unreachable, the least time between two tries.
        capacity_bytes: quota of this namespace (puts beyond it return False); None: no quota,
            capacity is the server's ``maxmemory`` (or the server's RAM when that is unlimited)
            and puts fail only when the server refuses them.
        latency_window: round trips kept for the latency percentiles.

    Nothing is sent at construction: an unreachable server is found out on first use.
    """

    name = "remote"

    def __init__(self, url: str, *, key_prefix: str = "kvtier:", socket_timeout_s: float = 0.5,
                 retry_interval_s: float = 1.0, capacity_bytes: int | None = None,
                 latency_window: int = 4096) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:  # an optional dependency: only L4 needs it
            raise ImportError("RemoteTier needs the Redis client: pip install 'redis>=5'") from e

        self.url = check_url(url)
        check_key_prefix(key_prefix)
        socket_timeout_s = check_seconds("socket_timeout_s", socket_timeout_s, allow_zero=False)
        retry_interval_s = check_seconds("retry_interval_s", retry_interval_s, allow_zero=True)
        check_quota(capacity_bytes)
        check_window(latency_window)

        self.socket_timeout_s = socket_timeout_s
        # a fixed retry interval: each try costs at most socket_timeout_s
        self._start(f"RemoteTier {_redact(url)}", _redact(self.url), key_prefix, capacity_bytes,
                    retry_interval_s, 1.0, latency_window, log)
        self._prefix_b = key_prefix.encode("utf-8")
        self._used_key = self._prefix_b + b"\x00used"
        self._redis = redis
        # One immediate retry on a broken connection (a pooled socket to a restarted server),
        # none on a timeout: a black-holed server costs at most socket_timeout_s per try.
        self._r = redis.Redis.from_url(
            url, socket_timeout=self.socket_timeout_s, socket_connect_timeout=self.socket_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            health_check_interval=0)
        self._put_sha = sha1(_PUT_LUA.encode()).hexdigest()
        self._del_sha = sha1(_DEL_LUA.encode()).hexdigest()
        self._last_used = 0
        self._server_info: dict = {}
        self._server_info_at = -1e9

    # -- connection state ------------------------------------------------------------------------

    def _round_trip(self, fn, fallback, n_keys: int = 1):
        """Run ``fn`` (one round trip) unless the server is known down; a failure returns ``fallback``."""
        self._check_open()
        if self._reach.skip(n_keys):
            return fallback
        errs = self._redis.exceptions
        t0 = time.perf_counter()
        try:
            out = fn()
        except (errs.ConnectionError, errs.TimeoutError, OSError) as e:
            self._went_down(e)
            return fallback
        except errs.RedisError as e:
            # The server answered but refused (OOM under noeviction, read-only replica, ...).
            self._reach.count_error()
            self._reach.warn_limited("RemoteTier %s refused a request: %s", _redact(self.url), e)
            self._reach.came_up()
            return fallback
        self._reach.came_up(time.perf_counter() - t0)
        return out

    def _went_down(self, e: Exception) -> None:
        self._r.connection_pool.disconnect()  # drop sockets to the old server process
        self._reach.went_down(f"{type(e).__name__}: {e}")

    # -- scripts ---------------------------------------------------------------------------------

    def _eval_batches(self, sha: str, lua: str, batches: list[tuple[list, list]]) -> list:
        """Run one script per batch in a single pipeline; a batch the server refused gives an exception."""
        errs = self._redis.exceptions
        results: list = [None] * len(batches)
        todo = list(range(len(batches)))
        for attempt in range(2):
            pipe = self._r.pipeline(transaction=False)
            for i in todo:
                keys, args = batches[i]
                pipe.evalsha(sha, len(keys), *keys, *args)
            out = pipe.execute(raise_on_error=False)
            missing = []
            for i, res in zip(todo, out):
                if isinstance(res, errs.NoScriptError) and attempt == 0:
                    missing.append(i)  # a restarted server forgot the script: load and rerun
                else:
                    results[i] = res
            if not missing:
                break
            self._r.script_load(lua)
            todo = missing
        return results

    # -- the Tier interface ----------------------------------------------------------------------

    def _skey(self, key: str) -> bytes:
        return self._prefix_b + check_key(key).encode("utf-8")

    @property
    def capacity_bytes(self) -> int:
        """The namespace quota if one was given; else the server's maxmemory (its RAM when
        unlimited), or 0 while the server has never been reached."""
        if self._quota is not None:
            return self._quota
        info = self._info(max_age_s=10.0)
        return int(info.get("maxmemory") or info.get("total_system_memory") or 0)

    @property
    def used_bytes(self) -> int:
        """Bytes of this namespace's records, frames included (last known value while down)."""
        raw = self._round_trip(lambda: self._r.get(self._used_key), None)
        if raw is not None:
            self._last_used = int(raw)
        elif self._reach.connected:
            self._last_used = 0
        return self._last_used

    def _info(self, max_age_s: float) -> dict:
        if self._closed or time.monotonic() - self._server_info_at <= max_age_s:
            return self._server_info
        info = self._round_trip(lambda: self._r.info("memory"), None)
        if info is not None:
            self._server_info, self._server_info_at = info, time.monotonic()
        return self._server_info

    def _check_values(self, items: list[tuple[str, BytesLike]]) -> tuple[list[bytes], list[bytes]]:
        cap = self._quota
        keys, framed = [], []
        for key, value in items:
            skey = self._skey(key)
            mv = as_byte_view(value)
            limit = min(MAX_VALUE_BYTES, cap - HEADER_BYTES if cap is not None else MAX_VALUE_BYTES)
            if mv.nbytes > limit:
                raise ValueError(f"value of {mv.nbytes} bytes exceeds what RemoteTier can hold "
                                 f"({max(limit, 0)} bytes: capacity_bytes or Redis' 512 MiB limit, less the "
                                 f"{HEADER_BYTES}-byte frame)")
            keys.append(skey)
            framed.append(frame(key, mv))
        return keys, framed

    def put(self, key: str, value: BytesLike) -> bool:
        return self.put_many([(key, value)])[0]

    def put_many(self, items: Iterable[tuple[str, BytesLike]]) -> list[bool]:
        """Store every item in one round trip (a pipeline of script calls); False where it did not fit
        or the server was unreachable or refused."""
        self._check_open()
        items = list(items)
        if not items:
            return []
        skeys, framed = self._check_values(items)
        n = len(items)
        cap = str(self._quota or 0).encode()
        spans = list(_chunks(n, [len(f) for f in framed]))
        batches = [([self._used_key, *skeys[s]], [cap, *framed[s]]) for s in spans]
        res = self._round_trip(lambda: self._eval_batches(self._put_sha, _PUT_LUA, batches), None, n)
        ok = [False] * n
        if res is not None:
            for s, r in zip(spans, res):
                if isinstance(r, Exception):
                    self._reach.count_error()
                    self._reach.warn_limited("RemoteTier %s refused %d puts: %s", _redact(self.url), s.stop - s.start, r)
                    continue
                ok[s] = [bool(x) for x in r]
        with self._lock:
            self._stats.puts += n
            self._stats.bytes_in += sum(len(f) - HEADER_BYTES for f, good in zip(framed, ok) if good)
            self._rejected += ok.count(False)
        return ok

    def get(self, key: str) -> memoryview | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Iterable[str]) -> list[memoryview | None]:
        """Fetch every key in one round trip; None where absent, corrupt, foreign or unreachable."""
        self._check_open()
        keys = list(keys)
        skeys = [self._skey(k) for k in keys]
        if not keys:
            return []

        def fetch():
            pipe = self._r.pipeline(transaction=False)
            for s in _chunks(len(skeys)):
                pipe.mget(skeys[s])
            return [raw for part in pipe.execute() for raw in part]

        raws = self._round_trip(fetch, [None] * len(keys), len(keys))
        out = [unframe(k, raw) for k, raw in zip(keys, raws)]
        self._count_gets(raws, out)
        bad = [k for k, raw, got in zip(keys, raws, out) if raw is not None and got is None]
        if bad:
            log.warning("RemoteTier %s: %d value(s) failed their frame/CRC check (first: %r); treated as misses",
                        _redact(self.url), len(bad), bad[0])
        return out

    def get_into(self, key: str, out) -> int | None:
        """Copy the value into ``out``; None when absent. ``out`` is checked before anything is
        counted, so a refused call (too small, read-only) leaves hits/misses unchanged."""
        out_view(out, 0)
        skey = self._skey(key)
        raw = self._round_trip(lambda: self._r.get(skey), None)
        got = unframe(key, raw)
        if got is not None:
            mv, dev = out_view(out, got.nbytes)
            if mv is not None:
                mv[:got.nbytes] = got
            elif got.nbytes:
                dev[:got.nbytes].copy_(torch.frombuffer(bytearray(got), dtype=torch.uint8))
        self._count_gets([raw], [got])
        return None if got is None else got.nbytes

    def _count_gets(self, raws: list, values: list) -> None:
        """Account reads: a value that came back but failed its frame/CRC check is a corrupt miss."""
        with self._lock:
            self._stats.gets += len(values)
            for raw, got in zip(raws, values):
                if got is None:
                    self._stats.misses += 1
                    self._corrupt += raw is not None
                else:
                    self._stats.hits += 1
                    self._stats.bytes_out += got.nbytes

    def contains(self, key: str) -> bool:
        skey = self._skey(key)
        return bool(self._round_trip(lambda: self._r.exists(skey), 0))

    def value_size(self, key: str) -> int | None:
        """Length of the value under ``key`` from the server (STRLEN: not fetched, not
        CRC-checked); None when absent or the server is unreachable."""
        skey = self._skey(key)
        n = self._round_trip(lambda: self._r.strlen(skey), 0)
        return n - HEADER_BYTES if n >= HEADER_BYTES else None

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        """Whether each key is on the server, in one round trip (a pipeline of EXISTS, one per
        key: a multi-key EXISTS only counts). False where absent or the server is unreachable.

        Like :meth:`contains`, this checks presence only: a value that later fails its frame/CRC
        check still reads as a miss in :meth:`get_many`. Nothing is counted as a hit or miss."""
        self._check_open()
        skeys = [self._skey(k) for k in keys]
        if not skeys:
            return []

        def exists():
            pipe = self._r.pipeline(transaction=False)
            for k in skeys:
                pipe.exists(k)
            return [bool(n) for n in pipe.execute()]

        return self._round_trip(exists, [False] * len(skeys), len(skeys))

    def delete(self, key: str) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Iterable[str]) -> list[bool]:
        """Delete every key in one round trip; False where absent or the server was unreachable."""
        self._check_open()
        skeys = [self._skey(k) for k in keys]
        if not skeys:
            return []
        spans = list(_chunks(len(skeys)))
        batches = [([self._used_key, *skeys[s]], []) for s in spans]
        res = self._round_trip(lambda: self._eval_batches(self._del_sha, _DEL_LUA, batches), None, len(skeys))
        ok = [False] * len(skeys)
        if res is not None:
            for s, r in zip(spans, res):
                if not isinstance(r, Exception):
                    ok[s] = [bool(x) for x in r]
        return ok

    def keys(self) -> Iterator[str]:
        """This namespace's keys (a snapshot taken by SCAN; nothing while the server is unreachable)."""
        pattern = self._glob_escape(self._prefix_b) + b"*"

        def scan():
            seen = set()
            for raw in self._r.scan_iter(match=pattern, count=1000):
                if b"\x00" not in raw[len(self._prefix_b):]:  # skip the byte counter
                    seen.add(raw[len(self._prefix_b):].decode("utf-8", "replace"))
            return sorted(seen)

        return iter(self._round_trip(scan, []))

    @staticmethod
    def _glob_escape(raw: bytes) -> bytes:
        out = bytearray()
        for b in raw:
            if b in b"*?[]\\":
                out += b"\\"
            out.append(b)
        return bytes(out)

    def resync(self) -> int:
        """Recount this namespace's bytes from the records actually on the server (after the server
        evicted some under its maxmemory policy). Returns the new ``used_bytes`` (-1 if unreachable).

        Not atomic with respect to other writers: run it while the namespace is quiet."""
        def count():
            ks = [self._prefix_b + k.encode("utf-8") for k in self.keys()]
            pipe = self._r.pipeline(transaction=False)
            for k in ks:
                pipe.strlen(k)
            total = sum(pipe.execute()) if ks else 0
            self._r.set(self._used_key, total)
            return total

        total = self._round_trip(count, -1)
        if total >= 0:
            self._last_used = total
        return total

    def stats(self) -> dict:
        """Tier counters plus: errors (failed round trips), skipped (keys not tried while the server
        was down), rejected (puts not stored), corrupt, outages, latency_p50_ms/latency_p99_ms per
        round trip, connected, and the server's used_memory/maxmemory/maxmemory_policy."""
        self._check_open()
        reach = self._reach.stats()  # snapshot before this call's own round trips
        info = self._info(max_age_s=0.0)
        with self._lock:
            s = self._stats.as_dict()
            s.update(rejected=self._rejected, corrupt=self._corrupt)
        s.update(reach)
        s.update(
            used_bytes=self.used_bytes, capacity_bytes=self.capacity_bytes, records=len(self),
            server_used_memory=int(info.get("used_memory", 0)),
            server_maxmemory=int(info.get("maxmemory", 0)),
            server_maxmemory_policy=str(info.get("maxmemory_policy", "")),
            connected=self.connected,
        )
        return s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._r.close()
        self._r.connection_pool.disconnect()

    def __repr__(self) -> str:
        return f"RemoteTier({_redact(self.url)!r}, key_prefix={self.key_prefix!r})"
