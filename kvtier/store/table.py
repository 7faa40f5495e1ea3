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
``slot`` is the entry's own L1 copy; the copies below L1 (``l2``/``l3``/``l4``) belong to its
:class:`BlockCopies`, which every entry holding the same content shares:

```
 seq 0, layer 3: [e0][e1][e2][open]      e0.rec ─┐  BlockCopies("m…/3/h0", refs=2, l2, l3, l4)
 seq 1, layer 3: [e0][e1][open]          e0.rec ─┘
```
Blocks of sequences without token ids get a private ``BlockCopies`` keyed by their process-local
key (refs 1).

Each table owns a fixed *region* of the L1 pool: ``cap`` (= ``device_blocks``) consecutive slots
from ``base``; its resident blocks (at most ``cap``) live there, ``at[p]`` is the entry at
region position ``p`` (slot ``base + p``). Only scratch slots (misses while the region is full)
lie outside it. ``KVStore.gather_view`` arranges the region so that the attended blocks are one
contiguous run of slots:

```
 region of seq 0, layer 3 (cap 8), 3 blocks selected:
   position  0    1    2    3      4    5    6    7
            [b9] [b2] [b11][open] [b5] [ -- ][b7] [ -- ]
            └─── selected ────┘└ open ┘ └── other residents, free ──┘
   K view = storage[0, :, base:base+4] as [kv_heads, 4*bt, head_dim], narrowed to the length
``` The L1 budget stays per sequence: a shared block may be resident in the L1 of each
sequence that attends it, but is stored once in each tier below.

The bookkeeping fields are written by ``Residency`` (residency.py) under the state lock. The
read caches of a table (``gather_cache``, ``view_cache``, ``view_n``, ``run_kv``) are used only
by the thread that reads that table.
"""
from __future__ import annotations

import torch


class BlockCopies:
    """The copies below L1 of one block's content, under its tier key.

    ``entries`` are the block entries (of any sequences) holding this content: the reference
    count is ``len(entries)``, and the copies are deleted from the tiers when it drops to 0.
    ``content`` is True for content-addressed keys (shared across sequences and processes).
    """

    __slots__ = ("key", "content", "l2", "l3", "l4", "written_through", "l2_bytes", "l3_bytes", "entries",
                 "l2_codec", "upgrade", "marks")

    def __init__(self, key: str, content: bool = False) -> None:
        self.key = key
        self.content = content
        self.l2 = False                # a valid copy in L2 (host codec record)
        self.l3 = False                # a valid copy in L3 (disk codec record, lz4 stage)
        self.l4 = False                # published to the remote tier (same bytes as L3)
        # the L3 copy was written through (or found on disk), not spilled from L2: it persists
        # and shares the block, but an evicted block still goes to L2 (DRAM, host codec) first
        self.written_through = False
        self.l2_bytes = 0
        self.l3_bytes = 0
        self.entries: list[BlockEntry] = []
        # precision="importance": the codec of the L2 record (None: the host codec), and whether
        # a recall found it heavy while it is below the base codec (read the L3 copy instead)
        self.l2_codec: str | None = None
        self.upgrade = False
        self.marks = 0  # times marked for upgrade (the generation of what its copies decode to)

    @property
    def refs(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"BlockCopies({self.key}, refs={self.refs}, l2={self.l2}, l3={self.l3}, l4={self.l4})"


def _delegate(name: str) -> property:
    def get(self):
        return getattr(self.rec, name)

    def set(self, value):
        setattr(self.rec, name, value)

    return property(get, set, doc=f"``rec.{name}`` (shared by every entry holding this content)")


class BlockEntry:
    __slots__ = ("idx", "key", "rec", "slot", "pending", "cancel",
                 "last_used", "mass", "importance", "fence", "evict_codec", "rel_mass", "seen", "low_gen",
                 "held")

    def __init__(self, idx: int, key: str) -> None:
        self.idx = idx
        self.key = key                 # process-local key: L1 slot, prefetch buffer
        self.rec = BlockCopies(key)    # copies below L1; replaced by a shared one when sealed
        self.rec.entries.append(self)
        self.slot: int | None = None   # L1 slot in the device pool
        self.pending = False           # queued for / being swapped out; slot still valid
        self.cancel = False            # re-used while pending: keep the slot after the copy
        self.last_used = 0             # store step of the last append/gather touching it (lru)
        self.mass = 0.0                # accumulated attention mass (h2o)
        self.importance = 0.0          # mass observed at the end of prefill (snapkv)
        self.fence = None              # CUDA event after the last write into the slot
        self.evict_codec: str | None = None  # precision="importance": codec chosen when marked pending
        self.rel_mass = 0.0            # precision="importance": sum over observations of mass / mean mass
        self.seen = 0                  # observations of this block (rel_mass / seen: its mean share)
        # precision="importance": the record's generation (``rec.marks``) when the L1 copy was
        # decoded from a copy below the base codec; None when the L1 copy is not such a decode
        self.low_gen: int | None = None
        # its swap-out failed (the codec or a tier put raised): it stays in L1 at full precision
        # and is never chosen again, so that one bad block fails one swap-out, not every step's
        self.held = False

    l2 = _delegate("l2")
    l3 = _delegate("l3")
    l2_bytes = _delegate("l2_bytes")
    l3_bytes = _delegate("l3_bytes")

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
        """Leaving L1 needs no write: a copy exists in L2, or in L3 as the spill of one."""
        rec = self.rec
        return rec.l2 or (rec.l3 and not rec.written_through)

    def __repr__(self) -> str:
        return (f"BlockEntry({self.key}, slot={self.slot}, pending={self.pending}, l2={self.l2}, "
                f"l3={self.l3}, mass={self.mass:.3g})")


#: Per-channel key summaries each ``select_score`` needs, side by side in a digest row.
DIGEST_PARTS = {"centroid": ("mean",), "quest": ("max", "min")}
#: Digest rows a new table holds; a seal past them grows the table (:func:`grown_rows`).
DIGEST_START_ROWS = 16


#: growth of a full digest table: geometric, so a sequence's seals copy each row a bounded number
#: of times on average (about 1 / (factor - 1) = 4), with at most a quarter of the rows held unused;
#: at small sparse budgets the digest is most of L1's bytes, and doubling held up to twice them
DIGEST_GROWTH = 1.25


def grown_rows(cap: int, b: int) -> int:
    """Rows a digest table of ``cap`` rows grows to for row ``b``: by ``DIGEST_GROWTH`` at least
    (whole multiples of ``DIGEST_START_ROWS``)."""
    step = DIGEST_START_ROWS
    grown = -(-int(cap * DIGEST_GROWTH) // step) * step
    return max(b + 1, grown, cap + step)


def digest_rows_held(sealed: int) -> int:
    """Rows a table holds (capacity included) once blocks ``0 .. sealed - 1`` are sealed in turn."""
    cap = DIGEST_START_ROWS
    while cap < sealed:
        cap = grown_rows(cap, cap)  # the seal of block ``cap`` is the first past the table
    return cap


#: ``BlockTable``'s key digest dtype for ``digest_dtype="int4"``: two 4-bit codes a byte
#: (:func:`quantize_channels`); its value means are int8 rows.
INT4 = torch.uint8


def digest_row_bytes(kv_heads: int, head_dim: int, select_score: str, digest_parts: int,
                     digest_dtype: torch.dtype, value_parts: int = 0) -> int:
    """Bytes of one sealed block's digest over its kv heads (:class:`BlockTable`'s row: the
    summaries ``select_score`` needs of each of ``digest_parts`` sub-blocks, the means of the
    values of each of ``value_parts`` sub-blocks, and with int8 ``digest_dtype`` one float32
    scale per sub-block of each; int4 (:data:`INT4`): half a byte per key channel and sub-block
    plus a float16 scale and zero per channel, the value means as int8)."""
    if digest_dtype == INT4:
        keys = digest_parts * head_dim // 2 + 2 * head_dim * 2
        return kv_heads * (keys + value_parts * (head_dim + 4))
    parts = len(DIGEST_PARTS[select_score]) * digest_parts + value_parts
    scales = (digest_parts + value_parts) * 4 if digest_dtype == torch.int8 else 0
    return kv_heads * (parts * head_dim * torch.empty((), dtype=digest_dtype).element_size() + scales)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of each row of ``x`` [..., n] against its own absmax: (int8 [..., n],
    float32 scale [...]) with ``x ~ q * scale`` and ``|x - q * scale| <= scale / 2`` (absmax / 254).
    Symmetric, no zero point: a score is ``scale * (q_query . q_row)``, one multiply per row."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127.0
    # an all-zero row keeps scale 0 and codes 0 (the divisor only has to be nonzero)
    q = torch.round(x / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` (the inverse of :func:`quantize_rows` up to its rounding)."""
    return q.float() * scale.unsqueeze(-1)


#: float16's largest finite value: scales and zeros beyond it are clamped (keys that large
#: would overflow the model's own float16 attention first)
_F16_MAX = 65504.0


def quantize_channels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes of ``x`` [kv_heads, parts, head_dim] per channel over its
    ``parts`` rows (one block's key rows): ``(packed uint8 [kv_heads, parts * head_dim // 2],
    float16 [kv_heads, 2 * head_dim] = scale | zero)`` with ``x ~ code * scale + zero``, code in
    0..15. The block's ``parts * head_dim`` codes (row-major) are split in halves: the first half
    in the low nibbles of its bytes, the second in the high ones (each half unpacks as one
    contiguous run, the scorer's fastest form).

    Per channel, not per row: a key row's absmax is several times its median channel (RoPE
    and per-channel offsets), so a row-wise 4-bit grid loses the small channels; over one
    block's rows each channel spans a narrow range (docs/results/long-answers.md). The codes
    are rounded against the float16 scale and zero as stored, so the error per channel is at
    most half a step (plus float16's rounding of the zero). A score is cheap from it: within a
    block ``q . row = (q * scale) . codes + q . zero``."""
    x = x.float()
    lo, hi = torch.aminmax(x, dim=1)  # [kv_heads, head_dim]
    scale = ((hi - lo) / 15.0).clamp_(max=_F16_MAX).half()
    zero = lo.clamp(-_F16_MAX, _F16_MAX).half()
    s, z = scale.float().unsqueeze(1), zero.float().unsqueeze(1)
    codes = torch.round((x - z) / torch.where(s > 0, s, 1.0)).clamp_(0, 15).to(torch.uint8)
    flat = codes.reshape(x.shape[0], -1)  # [kv_heads, parts * head_dim]
    half = flat.shape[1] // 2
    return flat[:, :half] | (flat[:, half:] << 4), torch.cat((scale, zero), dim=1)


def dequantize_channels(packed: torch.Tensor, sz: torch.Tensor, parts: int) -> torch.Tensor:
    """float32 ``[..., parts, head_dim]`` from :func:`quantize_channels`' packed codes
    ``[..., parts * head_dim // 2]`` and float16 scale | zero ``[..., 2 * head_dim]``."""
    hd = sz.shape[-1] // 2
    codes = torch.cat((packed & 15, packed >> 4), dim=-1).view(*packed.shape[:-1], parts, hd)
    s, z = sz.float().split(hd, dim=-1)
    return codes.float() * s.unsqueeze(-2) + z.unsqueeze(-2)


class BlockTable:
    """Blocks of one layer of one sequence, plus their digests (kept on the L1 device).

    ``digest`` (sparse attention only, else None): per sealed block and kv head, the per-channel
    summaries of its keys that ``select_score`` ranks by, in the KV dtype (scores are computed in
    float32 from it). ``centroid``: the mean (ArkVale's centre) -> ``[kv_heads, cap, head_dim]``;
    ``quest``: max | min (Quest's upper bound of q.k) -> ``[kv_heads, cap, 2 * head_dim]``.
    With ``digest_parts`` > 1 (centroid only) a row holds the means of that many equal sub-blocks
    side by side -> ``[kv_heads, cap, parts * head_dim]``.
    ``digest_dtype`` int8 (``KVTierConfig.digest_dtype``): the same rows as int8 codes, each
    sub-block's (each quest row's) against its own absmax, with ``digest_scale`` float32
    ``[kv_heads, cap, parts]`` (:func:`quantize_rows`).
    ``digest_dtype`` :data:`INT4` (centroid only): a block's sub-block centroids as 4-bit codes
    per channel, packed two a byte -> ``[kv_heads, cap, parts * head_dim // 2]`` uint8, with
    ``digest_scale`` float16 ``[kv_heads, cap, 2 * head_dim]`` (each channel's scale | zero over
    the block: :func:`quantize_channels`).
    ``value_parts`` > 0 (``rest_attention="estimate"``): ``vdigest`` holds the means of the
    values of that many equal sub-blocks per sealed block and kv head ->
    ``[kv_heads, cap, value_parts * head_dim]``, stored as the key digest is (int8 codes with
    ``vdigest_scale`` ``[kv_heads, cap, value_parts]`` for int8 and int4 key digests, or the KV
    dtype); else None.
    Rows ``[0, n_sealed)`` are valid; the table's row capacity grows by a quarter (``DIGEST_GROWTH``) when a seal needs more.
    """

    def __init__(self, seq: int, layer: int, kv_heads: int, head_dim: int, device: torch.device,
                 digest_dtype: torch.dtype, select_score: str | None = None, digest_parts: int = 1,
                 base: int = 0, cap: int = 0, value_parts: int = 0) -> None:
        self.seq = seq
        self.layer = layer
        self.base = base                       # first L1 slot of this table's region
        self.cap = cap                         # region size (device_blocks)
        self.at: list[BlockEntry | None] = [None] * cap  # region position -> resident entry
        self.length = 0                        # tokens appended
        self.entries: list[BlockEntry] = []    # index = block index; the last one is open
        self.resident = 0                      # blocks holding an L1 slot (pending included)
        self.slotted: dict[int, BlockEntry] = {}  # those blocks by index (the policy scans only these)
        self.pending = 0                       # of which queued for swap-out
        self.observed = 0                      # observe() calls so far (snapkv freezes after a few)
        self.pinned: frozenset[int] = frozenset()  # blocks a read in progress needs: never evicted
        self.head_dim = head_dim
        # (slots, blocks, index tensor, positions tensor) of the last gather_blocks (reads.py)
        self.gather_cache: tuple | None = None
        # (block order, positions tensor) of the last gather_view (reads.py)
        self.view_cache: tuple | None = None
        self.view_n = 0                        # blocks in the last gather_view run (positions [0, n))
        self.run_kv: tuple | None = None       # the region as K, V runs [kv_heads, cap*bt, hd] (reads.py)
        self.open_view: torch.Tensor | None = None  # L1 slot of the open block (append.py)
        self.open_np = None                    # the same slot as a numpy array (CPU store)
        self.select_score = select_score
        self.digest_parts = digest_parts
        self.value_parts = value_parts
        self.digest: torch.Tensor | None = None
        self.digest_scale: torch.Tensor | None = None  # int8 digests: [kv_heads, cap, parts] float32
        self.vdigest: torch.Tensor | None = None
        self.vdigest_scale: torch.Tensor | None = None  # int8: [kv_heads, cap, value_parts] float32
        self._digest_t: tuple | None = None   # (lo, hi, views) of the last digest_t() call
        if select_score is not None:
            rows = DIGEST_START_ROWS
            if digest_dtype == INT4:
                assert select_score == "centroid" and head_dim % 2 == 0, (select_score, head_dim)
                self.digest = torch.empty(kv_heads, rows, digest_parts * head_dim // 2, dtype=INT4, device=device)
                self.digest_scale = torch.empty(kv_heads, rows, 2 * head_dim, dtype=torch.float16, device=device)
            else:
                width = len(DIGEST_PARTS[select_score]) * digest_parts * head_dim
                self.digest = torch.empty(kv_heads, rows, width, dtype=digest_dtype, device=device)
                if digest_dtype == torch.int8:
                    self.digest_scale = torch.empty(kv_heads, rows, digest_parts, dtype=torch.float32, device=device)
            if value_parts:
                vdtype = torch.int8 if digest_dtype == INT4 else digest_dtype
                self.vdigest = torch.empty(kv_heads, rows, value_parts * head_dim, dtype=vdtype, device=device)
                if vdtype == torch.int8:
                    self.vdigest_scale = torch.empty(kv_heads, rows, value_parts, dtype=torch.float32, device=device)

    def take_slot(self, e: BlockEntry, slot: int) -> None:
        """``e`` now holds L1 slot ``slot`` (store lock held)."""
        assert e.slot is None, f"block already resident: {e}"
        e.slot = slot
        self.resident += 1
        self.slotted[e.idx] = e
        p = slot - self.base
        if 0 <= p < self.cap:
            assert self.at[p] is None, f"region position {p} of {self.seq}/{self.layer} taken by {self.at[p]}"
            self.at[p] = e

    def relocate(self, e: BlockEntry, slot: int) -> None:
        """``e`` moved from one region position to another (its data copied; store lock held)."""
        self.at[e.slot - self.base] = None
        p = slot - self.base
        assert self.at[p] is None, f"region position {p} of {self.seq}/{self.layer} taken by {self.at[p]}"
        self.at[p] = e
        e.slot = slot

    def swap_positions(self, a: BlockEntry, b: BlockEntry) -> None:
        """``a`` and ``b`` exchanged their region positions (store lock held)."""
        pa, pb = a.slot - self.base, b.slot - self.base
        self.at[pa], self.at[pb] = b, a
        a.slot, b.slot = b.slot, a.slot

    def free_position(self, lo: int = 0) -> int | None:
        """The first free region position >= ``lo``, or None."""
        at = self.at
        for p in range(lo, self.cap):
            if at[p] is None:
                return p
        return None

    def free_slot(self, e: BlockEntry) -> None:
        """``e`` left L1; the caller deleted its slot (store lock held)."""
        p = e.slot - self.base
        if 0 <= p < self.cap:
            self.at[p] = None
        e.slot = None
        e.low_gen = None
        self.resident -= 1
        del self.slotted[e.idx]

    @property
    def n_sealed(self) -> int:
        return max(0, len(self.entries) - 1)

    def _digest_tensors(self) -> tuple:
        """The tensors the digest rows live in (keys, their scales, value means, theirs)."""
        return tuple(x for x in (self.digest, self.digest_scale, self.vdigest, self.vdigest_scale)
                     if x is not None)

    def digest_row_bytes(self) -> int:
        """Bytes of one sealed block's digest, value means and int8 scales included (0 without
        digests)."""
        return sum(x.shape[0] * x.shape[2] * x.element_size() for x in self._digest_tensors())

    def digest_reserved_bytes(self) -> int:
        """Bytes the digest table holds, capacity included."""
        return sum(x.numel() * x.element_size() for x in self._digest_tensors())

    def digest_t(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Digests of sealed blocks [lo, hi) as ``[kv_heads, width, hi - lo]`` (ready as the right
        operand of ``q @``); with sub-block centroids ``[kv_heads, head_dim, (hi - lo) *
        digest_parts]`` (block-major). int8 digests come as their codes, with their scales
        ``[kv_heads, 1, (hi - lo) * digest_parts]`` (column j stands for codes * scale[..., j]);
        the scales are None otherwise. Both are views of the table, never copies: scoring
        multiplies each column's dot product by its scale, so no dequantized range is kept.
        Kept while (lo, hi) stay the same: between two block boundaries every decode step
        scores the same candidate range. int4 digests come dequantized (float32, scales None):
        a copy of the range per call, not kept (it would be 8x the table's bytes); the CPU and
        CUDA scorers read the codes in place instead (score_cpu.py, score_triton.py)."""
        if self.digest.dtype == INT4:
            cen = dequantize_channels(self.digest[:, lo:hi], self.digest_scale[:, lo:hi], self.digest_parts)
            return cen.view(cen.shape[0], -1, self.head_dim).transpose(1, 2), None
        c = self._digest_t
        if c is not None and c[0] == lo and c[1] == hi:
            return c[2], c[3]
        rows = self.digest[:, lo:hi]  # [kv_heads, m, width]
        kvh = rows.shape[0]
        if self.digest_parts > 1:
            rows = rows.reshape(kvh, -1, self.head_dim)  # [kv_heads, m * parts, head_dim]
        scale = None
        if self.digest_scale is not None:
            scale = self.digest_scale[:, lo:hi].reshape(kvh, 1, -1)  # [kv_heads, 1, m * parts]
        view = rows.transpose(1, 2)
        self._digest_t = (lo, hi, view, scale)
        return view, scale

    def set_digest(self, b: int, keys: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """Record the digest of sealed block ``b``; keys, values: [kv_heads, block_tokens,
        head_dim] (values are read only when the table keeps value means)."""
        if self.digest is None:
            return
        if self.digest.is_inference() and not torch.is_inference_mode_enabled():
            # grown during an inference_mode() prefill; a plain copy can be written outside it
            self._set_digest_tensors([x.clone() for x in self._digest_tensors()])
        if b >= self.digest.shape[1]:
            self._set_digest_tensors([_grown(x, b) for x in self._digest_tensors()])
        if self.vdigest is not None:
            kvh, bt, hd = values.shape
            p = self.value_parts  # [kv_heads, parts, bt / parts, hd] -> means [kv_heads, parts, hd]
            self._put_row(self.vdigest, self.vdigest_scale, b,
                          values.reshape(kvh, p, bt // p, hd).mean(dim=2, dtype=torch.float32))
        kvh, bt, hd = keys.shape
        if self.select_score == "centroid":
            p = self.digest_parts  # [kv_heads, parts, bt / parts, hd] -> means [kv_heads, parts, hd]
            new = keys.reshape(kvh, p, bt // p, hd).mean(dim=2, dtype=torch.float32)
        else:
            lo, hi = torch.aminmax(keys, dim=1)  # [kv_heads, head_dim] each
            new = torch.cat((hi, lo), dim=1).unsqueeze(1)  # [kv_heads, 1, 2 * head_dim]
        self._put_row(self.digest, self.digest_scale, b, new)

    @staticmethod
    def _put_row(table: torch.Tensor, scales: torch.Tensor | None, b: int, new: torch.Tensor) -> None:
        """Row ``b`` of ``table`` becomes ``new`` [kv_heads, parts, width], as int8 codes with
        their ``scales`` when the table is int8, as packed 4-bit codes per channel with their
        scale | zero when it is :data:`INT4`."""
        kvh = new.shape[0]
        row = table[:, b]  # [kv_heads, parts * width]
        if scales is None:
            row.copy_(new.reshape(kvh, -1))
            return
        q, scale = quantize_channels(new) if table.dtype == INT4 else quantize_rows(new)
        row.copy_(q.view(kvh, -1))
        scales[:, b].copy_(scale)

    def _set_digest_tensors(self, new: list[torch.Tensor]) -> None:
        """Replace the digest tensors (in :meth:`_digest_tensors`' order) by ``new``."""
        it = iter(new)
        self.digest = next(it)
        self.digest_scale = None if self.digest_scale is None else next(it)
        self.vdigest = None if self.vdigest is None else next(it)
        self.vdigest_scale = None if self.vdigest_scale is None else next(it)
        self._digest_t = None  # views of the old tensors

    def value_means(self, blocks: torch.Tensor) -> torch.Tensor:
        """float32 ``[kv_heads, len(blocks), value_parts, head_dim]``: the value means of sealed
        ``blocks`` (int64 indices), dequantized."""
        return _rows_of(self.vdigest, self.vdigest_scale, blocks, self.value_parts)

    def key_centroids(self, blocks: torch.Tensor) -> torch.Tensor:
        """float32 ``[kv_heads, len(blocks), digest_parts, head_dim]``: the key centroids of
        sealed ``blocks`` (int64 indices; centroid digests), dequantized."""
        if self.digest.dtype == INT4:
            return dequantize_channels(self.digest.index_select(1, blocks),
                                       self.digest_scale.index_select(1, blocks), self.digest_parts)
        return _rows_of(self.digest, self.digest_scale, blocks, self.digest_parts)

    def copy_digest_from(self, src: "BlockTable") -> None:
        """This table's digests become a copy of ``src``'s (a fork)."""
        if src.digest is not None:
            def copy(x):
                return None if x is None else x.clone()
            self.digest, self.digest_scale = copy(src.digest), copy(src.digest_scale)
            self.vdigest, self.vdigest_scale = copy(src.vdigest), copy(src.vdigest_scale)
            self._digest_t = None


def _rows_of(table: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor, parts: int) -> torch.Tensor:
    """Rows ``blocks`` of a digest ``table`` [kv_heads, cap, parts * head_dim] as float32
    [kv_heads, len(blocks), parts, head_dim], times their int8 ``scales`` where given."""
    rows = table.index_select(1, blocks).view(table.shape[0], blocks.numel(), parts, -1)
    if scales is None:
        return rows.float()
    return dequantize_rows(rows, scales.index_select(1, blocks))


def _grown(old: torch.Tensor, b: int) -> torch.Tensor:
    """``old`` [kv_heads, cap, ...] with room for row ``b`` (:func:`grown_rows`)."""
    new = torch.empty((old.shape[0], grown_rows(old.shape[1], b), *old.shape[2:]), dtype=old.dtype,
                      device=old.device)
    new[:, : old.shape[1]] = old
    return new
