"""What a bounded L3 keeps: eviction order, admission and pins (a part DiskTier composes).

```
 offer_many(items) ──admission──► put ──► live bytes over the high watermark?
   (second-touch: a block name          │ yes: evict, in policy order, the records that are
    offered before, still in the        ▼      neither pinned nor kept by the owner (``keep``),
    ghost list)                       tombstones down to the low watermark; compaction
                                      then gives the space back
```
- **Eviction order**: ``lru`` (least recently read or written first) or ``lfu`` (fewest reads
  and writes first, least recent among equals). Records not touched since the directory was
  opened rank first, oldest written first (access history is not persisted).
- **Pins** (``pins.py``): a pinned record is never evicted. The PINS file is re-read
  when it changes, so ``kvtier cache pin`` reaches a tier that is serving.
- **keep**: the owner's say on what is in use (the store: records a live block references,
  and its process-local spill records), asked only of eviction candidates.
- **Admission** (``offer_many`` only; ``put_many`` always writes: it may hold the only copy):
  ``always`` writes every offered record; ``second-touch`` writes a block only when it is
  offered a second time while its name is still in the ghost list (the last ``GHOST_NAMES``
  names refused), so a one-off prompt never costs SSD writes.

A block's name is its key with the middle component replaced by ``*`` (``fp/*/hash`` for the
content keys ``fp/layer/hash``): every layer of a block is one name for pins and admission.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Literal

from .pins import PinFile, block_name

Eviction = Literal["none", "lru", "lfu"]
Admission = Literal["always", "second-touch"]
EVICTIONS = ("none", "lru", "lfu")
ADMISSIONS = ("always", "second-touch")
GHOST_NAMES = 1 << 18  # block names second-touch remembers (~100 bytes each)


class DiskPolicy:
    """Access history, admission state and pins of one DiskTier (guarded by the tier's lock,
    except ``victims``' calls of ``keep``, made with no tier lock held)."""

    def __init__(self, path: str, eviction: Eviction = "none", admission: Admission = "always") -> None:
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        self.eviction = eviction
        self.admission = admission
        self.pins = PinFile(path)
        self.keep: Callable[[list[str]], list[bool]] | None = None
        self._tick = itertools.count(1)
        self._last: dict[str, int] = {}  # key -> tick of its last read or write (since open)
        self._uses: dict[str, int] = {}  # key -> reads and writes since open (lfu only)
        self._ghost: OrderedDict[str, None] = OrderedDict()

    @property
    def tracking(self) -> bool:
        return self.eviction != "none"

    def touch(self, key: str) -> None:
        self._last[key] = next(self._tick)
        if self.eviction == "lfu":
            self._uses[key] = self._uses.get(key, 0) + 1

    def touch_many(self, keys: Iterable[str]) -> None:
        for k in keys:
            self.touch(k)

    def forget(self, keys: Iterable[str]) -> None:
        for k in keys:
            self._last.pop(k, None)
            self._uses.pop(k, None)

    def clear(self) -> None:
        self._last.clear()
        self._uses.clear()

    def admit(self, keys: list[str]) -> list[bool]:
        """Whether each offered record (not stored yet) is written now: one decision per block
        name in the call, so the layers of a block offered together are one touch."""
        if self.admission == "always":
            return [True] * len(keys)
        ghost, seen = self._ghost, {}
        out = []
        for k in keys:
            name = block_name(k)
            if name not in seen:
                seen[name] = name in ghost  # (stays until pushed out: later layers may follow)
                if not seen[name]:
                    ghost[name] = None
                    if len(ghost) > GHOST_NAMES:
                        ghost.popitem(last=False)
            out.append(seen[name])
        return out

    def rank(self, items: Iterable[tuple[str, tuple]]) -> list[tuple[str, int]]:
        """(key, record size) of every record that is not pinned, first to evict first."""
        pinned = self.pins.current().matches
        last, uses = self._last, self._uses
        if self.eviction == "lfu":
            order = [((uses.get(k, 0), last.get(k, 0), loc[0], loc[1]), k, loc[2])
                     for k, loc in items if not pinned(k)]
        else:
            order = [((last.get(k, 0), loc[0], loc[1]), k, loc[2]) for k, loc in items if not pinned(k)]
        order.sort()
        return [(k, size) for _, k, size in order]

    def victims(self, ranked: list[tuple[str, int]], need: int) -> list[tuple[str, int]]:
        """The first records of ``ranked`` the owner does not keep, adding up to ``need`` bytes."""
        out, freed, i = [], 0, 0
        while freed < need and i < len(ranked):
            batch = ranked[i:i + 256]
            i += len(batch)
            kept = self.keep([k for k, _ in batch]) if self.keep is not None else [False] * len(batch)
            for (k, size), keep in zip(batch, kept):
                if not keep:
                    out.append((k, size))
                    freed += size
                    if freed >= need:
                        break
        return out
