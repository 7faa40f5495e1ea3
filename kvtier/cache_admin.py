"""Managing an L3 directory from outside the process serving from it (``kvtier cache``).

``CacheDirectory(path)`` reads the segment files itself (``pread``, never a mapping: a file
compacted away or truncated under it is read as it was or skipped, never a crash), so ``ls``,
``stat`` and ``verify`` are safe while a store serves from the directory (they show it as of
the moment each file was read; the last record of the head may be a write in flight and is
not reported as damaged). ``pin``/``unpin`` write the PINS file, which a serving tier re-reads
(``kvtier.tiers.disk.pins``). What deletes records (``verify(drop=True)``, ``evict``,
``clear``) takes the directory's lock as a DiskTier would, and is refused with a ValueError
naming the owner's pid while a store holds it.
"""
from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier._crc import crc32
from kvtier.tiers.disk.pins import PinFile, block_name
from kvtier.tiers.disk.space import SEG_RE, is_tier_file, purge_directory
from kvtier.tiers.errors import DirectoryLockedError
from kvtier.tiers.disk.segment import FLAG_TOMB, REC_HEADER_BYTES, SEG_HEADER_BYTES, iter_headers


@dataclass(frozen=True)
class StoredRecord:
    key: str
    segment: int
    offset: int
    value_bytes: int
    record_bytes: int
    written_ns: int  # the segment file's mtime: a lower bound of the record's age
    ok: bool  # data CRC as read


@dataclass(frozen=True)
class Group:
    identity: str  # the key's first component (the model identity key), or "(process-local)"
    codec: str
    records: int
    bytes: int
    oldest_s: float
    newest_s: float


def _identity(key: str) -> str:
    first = key.split("/", 1)[0]
    return first if first.startswith("m") else "(process-local)"


def _codec(value: bytes) -> str:
    """The codec a stored block record names, or "?" when it is not one the store writes."""
    from kvtier.compress.bytestage import ByteStage
    from kvtier.store.blockrecord import unpack_block

    try:
        k, _ = unpack_block(ByteStage("lz4").unpack(value))
        return k.codec
    except Exception:  # any undecodable value: reported, never raised
        return "?"


class CacheDirectory:
    """One L3 directory, opened for inspection (nothing is written until an operation says so)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(self.path):
            raise ValueError(f"{self.path!r} is not a directory")
        names = os.listdir(self.path)
        if names and not any(is_tier_file(n) for n in names):
            raise ValueError(f"{self.path!r} holds no kvtier L3 files (LOCK, INDEX, seg-*.kvs)")

    # -- who holds it --------------------------------------------------------------------------
    def owner_pid(self) -> int | None:
        """The pid of the process serving from the directory, or None when none holds its lock."""
        lock = os.path.join(self.path, "LOCK")
        if not os.path.exists(lock):
            return None
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    return int(os.pread(fd, 32, 0).split()[0])
                except (ValueError, IndexError):
                    return -1
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def _open_tier(self, **kw):
        from kvtier.tiers import DiskTier

        held = sum(os.path.getsize(os.path.join(self.path, n)) for n in os.listdir(self.path) if SEG_RE.match(n))
        try:  # room for what is there and the tombstones a deletion appends
            return DiskTier(self.path, capacity_bytes=held + (128 << 20), segment_bytes=64 << 20, **kw)
        except DirectoryLockedError:
            pid = self.owner_pid()
            raise ValueError(f"{self.path!r} is in use by a running kvtier (pid {pid}): deleting records "
                             f"is refused while it serves; stop it first (ls, stat, verify and pin work "
                             f"meanwhile)") from None

    # -- reading -------------------------------------------------------------------------------
    def records(self, check: bool = True) -> list[StoredRecord]:
        """Every live record (the log replayed: a later record of a key wins, a tombstone
        removes it), its data CRC checked when ``check``."""
        ids = sorted(int(m.group(1)) for n in os.listdir(self.path) if (m := SEG_RE.match(n)))
        fds = {}
        for sid in ids:  # every file opened first: one compacted away meanwhile is still read whole
            try:
                fds[sid] = os.open(os.path.join(self.path, f"seg-{sid:012d}.kvs"), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
        live: dict[str, StoredRecord] = {}
        try:
            last = max(fds, default=None)
            for sid, fd in fds.items():
                st = os.fstat(fd)
                data = os.pread(fd, st.st_size, 0)
                recs = list(iter_headers(data, SEG_HEADER_BYTES, len(data)))
                for i, (pos, flags, klen, vlen, dcrc, size) in enumerate(recs):
                    k0 = pos + REC_HEADER_BYTES
                    try:
                        key = data[k0:k0 + klen].decode("utf-8")
                    except UnicodeDecodeError:
                        continue
                    if flags & FLAG_TOMB:
                        live.pop(key, None)
                        continue
                    ok = not check or crc32(data[k0:k0 + klen + vlen]) == dcrc
                    if not ok and sid == last and i == len(recs) - 1 and self.owner_pid() is not None:
                        continue  # the head's last record, maybe still being written
                    live[key] = StoredRecord(key, sid, pos, vlen, size, st.st_mtime_ns, ok)
        finally:
            for fd in fds.values():
                os.close(fd)
        return sorted(live.values(), key=lambda r: (r.segment, r.offset))

    def _value(self, r: StoredRecord) -> bytes:
        p = os.path.join(self.path, f"seg-{r.segment:012d}.kvs")
        with open(p, "rb") as f:
            f.seek(r.offset + REC_HEADER_BYTES + len(r.key.encode()))
            return f.read(r.value_bytes)

    def ls(self) -> list[Group]:
        """What is stored, grouped by identity and codec, with bytes and ages (seconds)."""
        now = time.time_ns()
        groups: dict[tuple[str, str], list[StoredRecord]] = {}
        for r in self.records(check=False):
            try:
                codec = _codec(self._value(r))
            except OSError:  # compacted away since the scan
                continue
            groups.setdefault((_identity(r.key), codec), []).append(r)
        return [Group(ident, codec, len(rs), sum(r.record_bytes for r in rs),
                      (now - min(r.written_ns for r in rs)) / 1e9, (now - max(r.written_ns for r in rs)) / 1e9)
                for (ident, codec), rs in sorted(groups.items())]

    def stat(self) -> dict:
        """Records, live and file bytes, pins, and the serving pid (None when idle)."""
        recs = self.records(check=False)
        files = [n for n in os.listdir(self.path) if SEG_RE.match(n)]
        pins = PinFile(self.path).current()
        return {"path": self.path, "records": len(recs), "live_bytes": sum(r.record_bytes for r in recs),
                "segments": len(files), "file_bytes": sum(os.path.getsize(os.path.join(self.path, n)) for n in files),
                "identities": len({_identity(r.key) for r in recs}), "pins": len(pins.by_label),
                "pinned_records": sum(pins.matches(r.key) for r in recs), "serving_pid": self.owner_pid()}

    def verify(self, drop: bool = False) -> list[StoredRecord]:
        """The live records whose data fails its CRC; with ``drop``, they are deleted (refused
        while a store serves from the directory)."""
        bad = [r for r in self.records(check=True) if not r.ok]
        if drop and bad:
            tier = self._open_tier()
            try:
                tier.delete_many([r.key for r in bad])
            finally:
                tier.close()
        return bad

    # -- pins ----------------------------------------------------------------------------------
    def pin(self, label: str, token_ids: Sequence[int] | None = None, block_tokens: int | None = None,
            keys: Sequence[str] | None = None, salt: str = "") -> int:
        """Pin under ``label`` the blocks of a token prefix (for every model identity stored
        here; ``block_tokens`` found from what is stored when not given; ``salt``: the tenant
        whose conversations stored it, as given to ``kvtier.attach``) or explicit ``keys``.
        Safe while serving. Returns how many block names were pinned."""
        names = set(block_name(k) for k in (keys or ()))
        if token_ids is not None:
            names |= self._prefix_names(list(token_ids), block_tokens, salt)
        if not names:
            raise ValueError("pin needs token ids (a prefix of at least one block) or keys")
        PinFile(self.path).add(label, names)
        return len(names)

    def unpin(self, label: str) -> None:
        PinFile(self.path).remove(label)

    def pins(self) -> dict[str, tuple[str, ...]]:
        return dict(PinFile(self.path).current().by_label)

    def _prefix_names(self, token_ids: list[int], block_tokens: int | None, salt: str = "") -> set[str]:
        from kvtier.store.prefix import chained_block_hashes

        stored = {block_name(r.key) for r in self.records(check=False)}
        idents = sorted({n.split("/", 1)[0] for n in stored if n.startswith("m")})
        if not idents:
            raise ValueError(f"{self.path!r} holds no content-addressed blocks to pin a prefix of")
        sizes = [block_tokens] if block_tokens is not None else [b for b in (16, 32, 64, 128, 256, 512, 1024)
                                                                  if b <= len(token_ids)]
        found = set()
        for fp in idents:
            for bt in sizes:
                hashes = chained_block_hashes(token_ids, bt, fp, salt=salt)
                names = {f"{fp}/*/{h}" for h in hashes}
                if block_tokens is not None or names & stored:
                    found |= names
        if not found:
            raise ValueError(f"no stored block starts with these {len(token_ids)} token ids (block sizes tried: "
                             f"{sizes}); give block_tokens to pin a prefix not stored yet")
        return found

    # -- deleting ------------------------------------------------------------------------------
    def evict(self, identity: str | None = None, older_than_s: float | None = None) -> int:
        """Delete the records of model identity ``identity`` (a key prefix; "(process-local)"
        for those) and/or written more than ``older_than_s`` ago; pinned ones are kept.
        Refused while serving. Returns how many were deleted."""
        if identity is None and older_than_s is None:
            raise ValueError("evict needs identity= and/or older_than_s=")
        if older_than_s is not None and (isinstance(older_than_s, bool) or not isinstance(older_than_s, (int, float))
                                         or older_than_s < 0):
            raise ValueError(f"older_than_s must be a number of seconds >= 0; got {older_than_s!r}")
        now = time.time_ns()
        pins = PinFile(self.path).current()
        drop = [r.key for r in self.records(check=False)
                if (identity is None or _identity(r.key) == identity or r.key.startswith(identity))
                and (older_than_s is None or now - r.written_ns > older_than_s * 1e9) and not pins.matches(r.key)]
        tier = self._open_tier()
        try:
            return sum(tier.delete_many(drop))
        finally:
            tier.close()

    def clear(self) -> tuple[int, int]:
        """Delete every record and the tier's files (pins too). Refused while serving.
        Returns (segment files removed, bytes freed)."""
        try:
            return purge_directory(self.path)
        except DirectoryLockedError:
            raise ValueError(f"{self.path!r} is in use by a running kvtier (pid {self.owner_pid()}); "
                             f"stop it first") from None
