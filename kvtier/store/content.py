"""The content index: content-addressed block keys, prefix sharing across sequences and
processes, and export of stored records.

A sealed block whose token ids are known gets the key ``content_fp/layer/chained hash``
(``prefix.py``, pure hashing): blocks with the same prefix share one record (reference counted),
an L3 copy left by an earlier process is adopted, and a new record is written through.
"""
from __future__ import annotations

import numpy as np
import torch

from .blockio import BlockIO
from .blockrecord import unpack_block
from .layout import Layout
from .offload import OffloadTiers
from .prefix import _token_bytes, block_key, chained_block_hashes, chained_block_keys
from .residency import Residency
from .stats import Counters
from .table import BlockEntry, BlockTable
from .writethrough import WriteThrough


class ContentIndex:
    def __init__(self, layout: Layout, content_fp: str | None, residency: Residency, io: BlockIO,
                 offload: OffloadTiers, counters: Counters, publisher: WriteThrough | None) -> None:
        self.layout = layout
        self.content_fp = content_fp
        self.residency = residency
        self.copies = residency.copies  # under the same (state) lock
        self.io = io
        self.offload = offload
        self.counters = counters
        self.publisher = publisher
        self._tokens: dict[int, _SeqTokens] = {}  # token ids noted per sequence (state lock)

    def key(self, layer: int, block_hash: str) -> str:
        return block_key(self.content_fp, layer, block_hash)

    # -- token ids -----------------------------------------------------------------------------

    def note_tokens(self, seq: int, token_ids, salt: str = "") -> None:
        """Hash the full blocks of ``token_ids`` (the next tokens of ``seq``, whose tenant key is
        ``salt``); blocks sealed before their ids arrived get their content keys now."""
        ids = _token_bytes(token_ids)
        with self.residency.lock:
            st = self._tokens.get(seq)
            if st is None:
                st = self._tokens[seq] = _SeqTokens(salt)
            elif st.salt != salt:
                raise ValueError(f"salt must stay the same for a sequence; sequence {seq} was noted "
                                 f"with another salt")
        # hashed outside the lock: a sequence's token ids are noted by its own caller only
        before = len(st.hashes)
        st.add(ids, self.layout.block_tokens, self.content_fp)
        after = len(st.hashes)
        if after > before:
            for t in self.residency.tables_of(seq):
                for e in t.entries[before:min(after, t.n_sealed)]:
                    self.assign(t, e)

    def tokens_noted(self, seq: int) -> int:
        with self.residency.lock:
            st = self._tokens.get(seq)
            return st.count if st is not None else 0

    def forget(self, seq: int) -> None:
        with self.residency.lock:
            self._tokens.pop(seq, None)

    def truncate(self, seq: int, n: int) -> None:
        """Forget the ids of ``seq`` past its first ``n`` tokens (the sequence was cut there)."""
        with self.residency.lock:
            st = self._tokens.get(seq)
            if st is not None:
                st.truncate(n, self.layout.block_tokens)

    def fork(self, src: int, dst: int) -> None:
        """``dst`` continues ``src``: the same ids so far."""
        with self.residency.lock:
            st = self._tokens.get(src)
            if st is not None:
                self._tokens[dst] = st.copy()

    def _hash_of(self, t: BlockTable, e: BlockEntry) -> str | None:
        with self.residency.lock:
            st = self._tokens.get(t.seq)
            return st.hashes[e.idx] if st is not None and e.idx < len(st.hashes) else None

    def assign(self, t: BlockTable, e: BlockEntry) -> None:
        """Give sealed entry ``e`` its content-addressed record if its token ids are known: join
        the existing record (dedup, refcount + 1) or create one, adopting an L3 copy left by an
        earlier process; a new record is queued for write-through to L3/L4."""
        h = self._hash_of(t, e)
        if h is None or not self.residency.may_get_content(e):
            return
        key = self.key(t.layer, h)
        adopt = None
        if self.copies.record_of(key) is None:
            adopt = self.offload.l3_size(key)
        rec, data = self.residency.join_content(e, key, adopt)
        if data is not None:
            self.publisher.submit(rec, data)

    # -- prefixes ------------------------------------------------------------------------------

    def prefix_hashes(self, token_ids, salt: str = "") -> tuple[np.ndarray, list[str]]:
        ids = _token_bytes(token_ids)
        if self.content_fp is None:
            return ids, []
        return ids, chained_block_hashes(ids, self.layout.block_tokens, self.content_fp, salt=salt)

    def match_prefix(self, token_ids, salt: str = "") -> int:
        """Leading tokens of ``token_ids`` available in some tier, in whole blocks (KVStore)."""
        ids = _token_bytes(token_ids)
        keys = [] if self.content_fp is None else \
            chained_block_keys(ids, self.layout.block_tokens, self.layout.num_layers, self.content_fp,
                               salt=salt)
        n = 0
        while n < len(keys) and all(self._available_locally(k) for k in keys[n]):
            n += 1
        if n < len(keys) and self.offload.l4 is not None:
            # the rest: one round trip for every key no local tier has, up to the first block
            # that lacks one everywhere
            missing = [[k for k in block if not self._available_locally(k)] for block in keys[n:]]
            found = iter(self.offload.l4.contains_many([k for block in missing for k in block]))
            for block in missing:
                if not all([next(found) for _ in block]):  # consume this block's answers in full
                    break
                n += 1
        self.count_lookup(ids.size, n * self.layout.block_tokens)
        return n * self.layout.block_tokens

    def count_lookup(self, tokens: int, hit_tokens: int, attached: bool = False) -> None:
        self.counters.add(prefix_lookups=1, prefix_lookup_tokens=int(tokens), prefix_hit_tokens=hit_tokens,
                          prefill_tokens_saved=hit_tokens if attached else 0)

    def _available_locally(self, key: str) -> bool:
        # an entry always has a copy somewhere (its home)
        return self.copies.available(key) or self.offload.l3_holds(key)

    def read_blocks(self, block_hash: str) -> list[torch.Tensor] | None:
        """Decoded [2, kv_heads, block_tokens, head_dim] blocks of ``block_hash``, one per layer:
        L1 copies first, then one ``read_copies`` for every other layer (each lower tier read
        once for all of them: a record this process holds from the tiers it has copies in, any
        other by key from L3 and L4); None when a layer is in none of them (a corrupt copy is a
        miss of its layer, never its KV)."""
        keys = [self.key(layer, block_hash) for layer in range(self.layout.num_layers)]
        out: list[torch.Tensor | None] = []
        below = []  # (layer, record or bare key) of the layers not resident
        for layer, key in enumerate(keys):
            rec, data = self.residency.resident_copy(key)
            out.append(data)
            if data is None:
                below.append((layer, key if rec is None else rec))
        if below:
            for (layer, _), d in zip(below, self.offload.read_copies([r for _, r in below], self.layout.device)):
                out[layer] = d
        return None if any(d is None for d in out) else out

    # -- export --------------------------------------------------------------------------------

    def export_record(self, e: BlockEntry) -> bytes:
        """The disk-codec record of sealed ``e``: the stored one if there is one, else encoded
        (with ``precision="importance"`` a stored record of another codec is transcoded: a
        saved file holds one codec)."""
        l2, l3, key, data = self.residency.export_state(e)
        raw = self.offload.stored_record(key, l2, l3)
        if raw is not None:
            if self.layout.precision is None or unpack_block(raw)[0].codec == self.layout.disk_codec:
                return raw
            return self.io.encode(self.io.decode(raw, "l3", torch.device("cpu")), "l3")
        if data is None:
            data = self.offload.load(e)  # [2, kv_heads, block_tokens, head_dim]
        return self.io.encode(data.to("cpu"), "l3")


class _SeqTokens:
    """Token ids noted for one sequence: the chained hash of every full block, and the tail."""

    __slots__ = ("hashes", "tail", "count", "ids", "salt")

    def __init__(self, salt: str = "") -> None:
        self.salt = salt  # the tenant key every hash of this sequence is chained from
        self.hashes: list[str] = []
        self.tail = np.empty(0, dtype="<i8")
        self.count = 0
        self.ids: list[np.ndarray] = []  # every id noted, in chunks (truncate needs them back)

    def add(self, ids: np.ndarray, block_tokens: int, fp: str) -> None:
        tail = np.concatenate((self.tail, ids)) if self.tail.size else ids
        n_full = tail.size // block_tokens
        if n_full:
            self.hashes += chained_block_hashes(tail[:n_full * block_tokens], block_tokens, fp,
                                                parent=self.hashes[-1] if self.hashes else None,
                                                salt=self.salt)
        self.tail = tail[n_full * block_tokens:].copy()
        self.count += int(ids.size)
        self.ids.append(np.array(ids, dtype="<i8"))

    def truncate(self, n: int, block_tokens: int) -> None:
        """Forget every id past the first ``n`` (the hashes of whole blocks before stay valid)."""
        if n >= self.count:
            return
        kept = np.concatenate(self.ids)[:n] if self.ids else np.empty(0, dtype="<i8")
        self.ids = [kept]
        self.hashes = self.hashes[: n // block_tokens]
        self.tail = kept[(n // block_tokens) * block_tokens:].copy()
        self.count = n

    def copy(self) -> "_SeqTokens":
        other = _SeqTokens(self.salt)
        other.hashes = list(self.hashes)
        other.tail = self.tail.copy()
        other.count = self.count
        other.ids = list(self.ids)  # chunks are never written after they are added
        return other
