"""The tiers below L1: L2 (DRAM ring), L3 (SSD segments), L4 (remote), spill and orphan reclaim.

Owns the tier lock (``lock``): every L2/L3 call runs under it, and it is always taken before the
state lock (``Residency.lock``). L4 calls are network round trips and take no lock (the remote
tier guards itself). A block's copy flags are read and its copy fetched in one hold of the tier
lock, so a spill cannot move the copy in between.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time

import torch

from kvtier.config import KVTierConfig

from .blockio import BlockIO
from .layout import Layout
from .stats import Counters
from .table import BlockCopies, BlockEntry

#: Tier keys of content-addressed blocks (``kvtier.store.prefix``): ``m<32 hex>/<layer>/<32 hex>``.
#: Only these survive a restart; process-local keys (``seq/layer/block``) are wiped on open.
CONTENT_KEY = re.compile(r"m[0-9a-f]{32}/[0-9]+/[0-9a-f]{32}")

log = logging.getLogger(__name__)


class OffloadTiers:
    def __init__(self, cfg: KVTierConfig, layout: Layout, io: BlockIO, counters: Counters) -> None:
        from kvtier.tiers import HostTier
        from kvtier.tiers.remotes import open_remote

        self.lock = threading.Lock()
        self.layout = layout
        self.io = io
        self.counters = counters
        # the residency part and its copy records, attached once they exist (they need L1 first)
        self.residency = None
        self.copies = None
        self._disk_full_warned = False
        # L3 first: an unwritable disk_path fails before anything is allocated.
        self.l3 = open_disk(cfg) if cfg.disk_path is not None else None
        if self.l3 is not None:
            self.l3.set_keep(self._in_use)
        self.l4 = open_remote(cfg.remote_url, key_prefix=cfg.remote_key_prefix) \
            if cfg.remote_url is not None else None
        self.l2 = HostTier(cfg.host_bytes, spill=self._spill if self.l3 is not None else None,
                           pin_memory=layout.cuda, overflow_bytes=cfg.host_overflow_bytes if self.l3 is not None else 0)

    # -- swap-in -------------------------------------------------------------------------------

    def load(self, e: BlockEntry, device: torch.device | None = None) -> torch.Tensor:
        """:meth:`load_many` of one block."""
        return self.load_many([e], device)[0]

    def load_many(self, entries: list[BlockEntry], device: torch.device | None = None) -> list[torch.Tensor]:
        """Read non-resident blocks from L2, L3 or L4 and decode them on ``device`` (each tier
        read once for the batch: :meth:`read_copies`)."""
        if not entries:
            return []
        device = self.layout.device if device is None else device
        t0 = time.perf_counter()
        out = self.read_copies([e.rec for e in entries], device)
        for e, d in zip(entries, out):
            if d is None:
                raise AssertionError(f"block {e.key} has no readable copy in any tier ({e}, {e.rec})")
        self.counters.add(swap_in_blocks=len(entries))
        self.counters.sample("swap_in", (time.perf_counter() - t0) / len(entries), len(entries))
        return out

    def load_l2_into(self, entries: list[BlockEntry], pool: torch.Tensor, slot_axis: int,
                     slots: list[int]) -> list[int | None]:
        """Swap-in straight into L1 (a CPU pool, the in-place decoder): each block of
        ``entries`` whose L2 copy is of the decoder's known layout is decoded into ``slots[i]`` of
        ``pool`` (its storage; ``BlockDecoder.decode_into``). Returns per block the generation of
        its record when its copy was read (as ``Prefetcher.fetch_many`` hands it over), or None
        where nothing was written: no L2 copy (or one due for an upgrade), another layout, or a
        batch with a corrupt record (every block of it None: :meth:`load_many` reads them one
        by one, the corrupt one a miss). The caller holds the pool still (no grow) and owns the
        slots."""
        out: list[int | None] = [None] * len(entries)
        dec = self.io.fast_decoder
        if dec is None or self.layout.l2_staged:
            return out
        t0 = time.perf_counter()
        with self.lock:
            reads = self.copies.l2_reads([e.rec for e in entries])
            take = [i for i, (key, _) in enumerate(reads) if key is not None]
            values = self.l2.get_many([reads[i][0] for i in take]) if take else []
        got = [(i, v) for i, v in zip(take, values) if v is not None]
        if not got:
            return out
        try:
            done = dec.decode_into([v for _, v in got], pool, slot_axis, [slots[i] for i, _ in got])
        except ValueError:  # a corrupt record: nothing written, every block left to load_many
            return out
        n = nbytes = 0
        for (i, v), ok in zip(got, done):
            if ok:
                out[i] = reads[i][1]
                n += 1
                nbytes += len(v)
        if n:
            self.counters.add(hits_l2=n, swap_in_l2_bytes=nbytes, swap_in_blocks=n)
            self.counters.sample("swap_in", (time.perf_counter() - t0) / n, n)
        return out

    def read_copies(self, recs: list[BlockCopies | str], device: torch.device) -> list[torch.Tensor | None]:
        """Each record's nearest readable copy decoded on ``device``; None where none could be
        read (absent, or corrupt: the tiers' CRCs turn damage into a miss). L2 and L3 are each
        read with one ``get_many`` for the batch, L2 first; what neither holds is asked of L4 in
        one round trip. A record marked for upgrade (``precision.py``) is read from its
        higher-precision L3 copy, and its low L2 copy dropped once that decoded.

        An item may be a bare tier key instead: content this process holds no record of (left
        in L3 by an earlier process, or published to L4 by another), looked for in L3 and L4 by
        key in the same reads; its L4 hits are noted (``Residency.note_l4``)."""
        out: list[torch.Tensor | None] = [None] * len(recs)
        anywhere = (False, self.l3 is not None, self.l4 is not None)
        with self.lock:
            want = []  # (position, l2, l3, l4, key) of the records an upgrade did not serve
            states = iter(self.copies.read_states([r for r in recs if not isinstance(r, str)]))
            for i, rec in enumerate(recs):
                if isinstance(rec, str):
                    want.append((i, *anywhere, rec))
                    continue
                due, *where = next(states)
                if due:
                    out[i] = self._upgrade(rec, device)
                    if out[i] is not None:
                        continue
                    where = self.copies.flags(rec)  # a failed upgrade leaves the copies as they are now
                want.append((i, *where))
            v2 = self._get_many(self.l2, [w[4] if w[1] else None for w in want])
            v3 = self._get_many(self.l3, [w[4] if w[2] and v is None else None for w, v in zip(want, v2)])
        l4 = []
        found = []  # (position, value, tier) of the copies read, decoded together below
        n = {"hits_l2": 0, "hits_l3": 0, "misses_l2": 0, "misses_l3": 0, "swap_in_l2_bytes": 0, "swap_in_l3_bytes": 0}
        for (i, in_l2, in_l3, in_l4, key), got2, got3 in zip(want, v2, v3):
            for tier, held, value in (("l2", in_l2, got2), ("l3", in_l3, got3)):
                if not held:
                    continue
                if value is not None:
                    found.append((i, value, tier))
                    break
                if not isinstance(recs[i], str):  # a bare key was only looked for: no copy missed
                    n[f"misses_{tier}"] += 1
            else:
                if in_l4:
                    l4.append((i, key))
        if found:
            try:
                decoded = self.io.decode_stored_many([f[1:] for f in found], device)
            except ValueError:  # a record's own CRCs failed: each alone, the bad ones a miss
                decoded = [self.io.try_decode_stored(value, tier, device) for _, value, tier in found]
            for (i, value, tier), d in zip(found, decoded):
                out[i] = d
                n[f"hits_{tier}" if d is not None else f"misses_{tier}"] += 1
                n[f"swap_in_{tier}_bytes"] += len(value) if d is not None else 0
        self.counters.add(**{k: x for k, x in n.items() if x})
        if l4:
            noted = []
            for (i, key), v4 in zip(l4, self.l4.get_many([key for _, key in l4])):
                out[i] = self.io.try_decode_l3(v4, device)
                if out[i] is not None:
                    self.counters.add(hits_l4=1, swap_in_l4_bytes=len(v4))
                    if isinstance(recs[i], str):
                        noted.append(key)
                else:
                    self.counters.add(misses_l4=1)
            if noted:
                self.copies.note_l4(noted)
        return out

    @staticmethod
    def _get_many(tier, keys: list[str | None]) -> list:
        """``tier.get_many`` of the keys that are not None, None in the other places."""
        ask = [k for k in keys if k is not None]
        got = iter(tier.get_many(ask) if ask else ())
        return [None if k is None else next(got) for k in keys]

    def _upgrade(self, rec: BlockCopies, device: torch.device) -> torch.Tensor | None:
        """The L3 backup of ``rec`` decoded on ``device``, its low L2 copy then dropped as a
        spill drops one (tier lock held); None, the mark cleared and the L2 copy kept, when the
        backup is missing or corrupt. Decoded under the lock: upgrades are rare, and no other
        read may see the L2 copy gone before the backup is known good."""
        value = self.l3.get(rec.key)
        try:
            out = None if value is None else self.io.decode_stored(value, "l3", device)
        except ValueError:  # corrupt bytes: a miss, never wrong data
            out = None
        if out is None:
            self.copies.upgrade_failed(rec)
            self.counters.add(precision_upgrade_failed=1, misses_l3=1)
            return None
        self.l2.delete(rec.key)
        self.residency.spilled([rec])
        self.counters.add(precision_upgrades=1, precision_upgrade_bytes=len(value), hits_l3=1,
                          swap_in_l3_bytes=len(value))
        return out

    def stored_record(self, key: str, l2: bool, l3: bool) -> bytes | None:
        """The disk-codec block record of ``key`` as stored (L3, or L2 when it uses the disk
        codec), framing and CRCs checked; None when no such copy is stored."""
        if l3:
            with self.lock:
                value = self.l3.get(key)
            if value is not None:
                return self.io.checked_raw(value, staged=True)
        if l2 and not self.layout.transcode:
            with self.lock:
                value = self.l2.get(key)
            if value is not None:
                return self.io.checked_raw(value, staged=self.layout.l2_staged)
        return None

    # -- L3 ------------------------------------------------------------------------------------

    def l3_holds(self, key: str) -> bool:
        if self.l3 is None:
            return False
        with self.lock:
            return self.l3.contains(key)

    def l3_size(self, key: str) -> int | None:
        """Bytes of the L3 value under ``key`` (from the index: nothing is read); None if absent."""
        if self.l3 is None:
            return None
        with self.lock:
            return self.l3.value_size(key)

    def put_l3(self, items: list) -> list[bool]:
        """``l3.put_many``; when L3 is full, unreferenced content records (left by drops with
        ``keep_prefix`` or by earlier processes) are reclaimed and the refused puts retried once
        (tier lock held)."""
        oks = self._l3_put_many(items)
        if not all(oks) and self._reclaim_orphans():
            redo = [i for i, ok in enumerate(oks) if not ok]
            for i, ok in zip(redo, self._l3_put_many([items[i] for i in redo])):
                oks[i] = ok
        return oks

    def _l3_put_many(self, items: list) -> list[bool]:
        """``l3.put_many`` where a full filesystem refuses the records it could not write (as a
        full L3 would) instead of ending the run: they stay in L2, or the publisher skips them.
        Warned once per store; counted in ``l3_disk_full``."""
        from kvtier.tiers import DiskFullError

        try:
            return self.l3.put_many(items)
        except DiskFullError as exc:
            self.counters.add(l3_disk_full=1)
            if not self._disk_full_warned:
                self._disk_full_warned = True
                log.warning("kvtier: the disk under disk_path is full (%s); blocks L3 cannot take stay in "
                            "L2 (free space there or lower disk_bytes)", exc)
            return [self.l3.contains(k) for k, _ in items]  # the ones written before it filled are kept

    def _in_use(self, keys: list[str]) -> list[bool]:
        """Which L3 records eviction must keep: process-local ones (a live sequence's only
        copy) and content records a live block references."""
        copies = self.copies
        live = copies.referenced(keys) if copies is not None else [True] * len(keys)
        return [ref or not CONTENT_KEY.fullmatch(k) for k, ref in zip(keys, live)]

    def offer_l3(self, items: list) -> list[bool | None]:
        """``l3.offer_many`` (the admission policy decides; None: turned away), with
        ``put_l3``'s reclaim of unreferenced records when L3 is full (tier lock held)."""
        oks = self.l3.offer_many(items)
        if False in oks and self._reclaim_orphans():
            redo = [i for i, ok in enumerate(oks) if ok is False]
            for i, ok in zip(redo, self._l3_put_many([items[i] for i in redo])):
                oks[i] = ok
        return oks

    def _reclaim_orphans(self) -> int:
        """Delete L3 content records no live block references (tier lock held)."""
        orphans = [k for k in self.copies.unreferenced(self.l3.keys()) if CONTENT_KEY.fullmatch(k)]
        if orphans:
            self.l3.delete_many(orphans)
            self.counters.add(orphans_deleted=len(orphans))
        return len(orphans)

    def _spill(self, items: list) -> None:
        """HostTier callback, called under the tier lock: the oldest L2 records go to L3.

        On success the ring drops every record of the batch. If L3 refuses some (full even after
        reclaiming unreferenced content records) this raises and the ring keeps them all: the
        ones that did land are then in both tiers, and the accounting says so.
        """
        out, already = [], []
        for key, value in items:
            rec = self.copies.record_of(key)
            if rec is None:
                continue  # dropped meanwhile: nothing to keep
            if rec.l3:
                already.append(rec)  # written through (content key) or landed in a failed batch
                continue
            out.append((key, rec, self.io.spill_record(value)))
        oks = self.put_l3([(k, p) for k, _, p in out]) if out else []
        stale = []
        for (key, rec, packed), ok in zip(out, oks):
            if ok:
                if self.copies.landed_l3(rec, len(packed), written_through=False):
                    self.counters.add(swap_out_l3_bytes=len(packed))
                else:
                    stale.append(key)
        if stale:
            self.l3.delete_many(stale)
        if not all(oks):
            raise RuntimeError(f"L3 refused {oks.count(False)} of {len(oks)} spilled blocks (disk_bytes full)")
        self.residency.spilled([r for _, r, _ in out] + already)

    # -- lifecycle -----------------------------------------------------------------------------

    def delete(self, l2_keys: list[str], l3_keys: list[str]) -> None:
        """Delete the copies of records whose last reference went, and recount what is held."""
        with self.lock:
            self.l2.delete_many(l2_keys)
            if self.l3 is not None:
                self.l3.delete_many(l3_keys)
            self.copies.recount()

    def close(self) -> None:
        try:
            if self.l4 is not None:
                self.l4.close()
        finally:
            if self.l3 is not None:
                self.l3.close()
            self.l2.close()


def open_disk(cfg: KVTierConfig):
    """The L3 tier at ``cfg.disk_path``, with process-local keys of an earlier store wiped."""
    from kvtier.tiers import DiskTier

    path = cfg.disk_path
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ValueError(f"disk_path must be a writable directory; cannot create {path!r}: {e}") from e
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"disk_path must be a writable directory; {path!r} is not")
    try:
        l3 = DiskTier(path, capacity_bytes=cfg.disk_bytes, segment_bytes=cfg.disk_segment_bytes,
                      durability=cfg.durability, eviction=cfg.disk_eviction, admission=cfg.disk_admission)
    except PermissionError as e:
        raise ValueError(f"disk_path must be a writable directory; {path!r}: {e}") from e
    # Process-local keys name (sequence, layer, block) of an earlier store: they cannot be
    # addressed again and would only take capacity. Content-addressed records are kept: a
    # later store of the same model and codecs finds them by key (reuse after restart).
    stale = [k for k in l3.keys() if not CONTENT_KEY.fullmatch(k)]
    if stale:
        l3.delete_many(stale)
    if cfg.disk_max_age_s is not None or cfg.disk_kept_bytes is not None:
        l3.expire(max_age_s=cfg.disk_max_age_s, max_bytes=cfg.disk_kept_bytes)  # all kept: none is live yet
    return l3
