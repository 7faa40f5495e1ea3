"""Per (sequence, layer) block tables.

```
 tokens   0 ........ bt-1 | bt ...... 2bt-1 | ... | (n-1)bt ... length-1
 blocks   [ sealed 0      ][ sealed 1       ] ... [ open n-1 (1..bt tokens) ]
```
A block is sealed lazily, when the first token of the next block arrives, so the open block is
never empty once anything was appended and the most recent tokens are always in it. Sealed
blocks never change; that is why a copy below L1 stays valid after a swap-in ("clean" block) and
a clean block leaves L1 by just freeing its slot.

Every sealed block has one *home*: L1 if it has a slot, else L2 if it has a copy there, else L3.
``slot``/``l2``/``l3`` are the copies; all fields are guarded by the store's lock.
"""
from __future__ import annotations

import torch


class BlockEntry:
    __slots__ = ("idx", "key", "slot", "pending", "cancel", "l2", "l3", "l2_bytes", "l3_bytes",
                 "last_used", "mass", "importance", "fence")

    def __init__(self, idx: int, key: str) -> None:
        self.idx = idx
        self.key = key
        self.slot: int | None = None   # L1 slot in the device pool
        self.pending = False           # queued for / being swapped out; slot still valid
        self.cancel = False            # re-used while pending: keep the slot after the copy
        self.l2 = False                # a valid copy in L2
        self.l3 = False                # a valid copy in L3
        self.l2_bytes = 0
        self.l3_bytes = 0
        self.last_used = 0             # store step of the last append/gather touching it (lru)
        self.mass = 0.0                # accumulated attention mass (h2o)
        self.importance = 0.0          # mass observed at the end of prefill (snapkv)
        self.fence = None              # CUDA event after the last write into the slot

    @property
    def home(self) -> str:
        if self.slot is not None:
            return "l1"
        if self.l2:
            return "l2"
        if self.l3:
            return "l3"
        return "none"

    @property
    def clean(self) -> bool:
        """Leaving L1 needs no write: a valid copy exists below."""
        return self.l2 or self.l3

    def __repr__(self) -> str:
        return (f"BlockEntry({self.key}, slot={self.slot}, pending={self.pending}, l2={self.l2}, "
                f"l3={self.l3}, mass={self.mass:.3g})")


class BlockTable:
    """Blocks of one layer of one sequence, plus their key digests (kept on the L1 device)."""

    def __init__(self, seq: int, layer: int, kv_heads: int, head_dim: int, device: torch.device,
                 digest_dtype: torch.dtype) -> None:
        self.seq = seq
        self.layer = layer
        self.length = 0                        # tokens appended
        self.entries: list[BlockEntry] = []    # index = block index; the last one is open
        self.resident = 0                      # blocks holding an L1 slot (pending included)
        self.pending = 0                       # of which queued for swap-out
        self.observed = 0                      # observe() calls so far (snapkv freezes after a few)
        self.head_dim = head_dim
        # per sealed block and kv head: per-channel max of the keys, then per-channel min (Quest)
        self.digest = torch.empty(16, kv_heads, 2 * head_dim, dtype=digest_dtype, device=device)

    @property
    def n_sealed(self) -> int:
        return max(0, len(self.entries) - 1)

    @property
    def open(self) -> BlockEntry | None:
        return self.entries[-1] if self.entries else None

    def set_digest(self, b: int, keys: torch.Tensor) -> None:
        """Record the digest of sealed block ``b``; keys: [kv_heads, block_tokens, head_dim]."""
        if b >= self.digest.shape[0]:
            old = self.digest
            self.digest = torch.empty((max(b + 1, 2 * old.shape[0]), *old.shape[1:]), dtype=old.dtype,
                                      device=old.device)
            self.digest[: old.shape[0]] = old
        hd = self.head_dim
        self.digest[b, :, :hd] = keys.amax(dim=1)  # [kv_heads, head_dim]
        self.digest[b, :, hd:] = keys.amin(dim=1)
