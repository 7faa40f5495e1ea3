"""One block (K and V) as one record: two codec records framed by a small header.

```
 offset 0   4 bytes  magic b"KVB1"
        4   u32 LE   length of the K record (n_k)
        8   u32 LE   length of the V record (n_v)
       12   n_k      K record  (kvtier.compress.record format)
  12 + n_k  n_v      V record
```
No pickle: both halves are parsed by ``unpack_record``, which checks its own header and CRC.
"""
from __future__ import annotations

import ctypes
import math
import struct

import numpy as np
import torch

from kvtier._crc import c_address
from kvtier.compress import cpu
from kvtier.compress.base import Encoded

_MAGIC = b"KVB1"
_HEADER = struct.Struct("<4sII")


def pack_block(k: Encoded, v: Encoded) -> bytes:
    """Frame the encoded K and V of one block into one record (owned bytes)."""
    from kvtier.compress.record import pack_record

    rk = pack_record(k)
    rv = pack_record(v)
    return b"".join((_HEADER.pack(_MAGIC, len(rk), len(rv)), rk, rv))


def _frame(buf) -> tuple[memoryview, int, int]:
    """The block record as bytes, and its K and V record lengths; checks the framing."""
    from kvtier.compress.record import CorruptRecordError

    mv = memoryview(buf).cast("B")
    if mv.nbytes < _HEADER.size:
        raise CorruptRecordError(f"block record is {mv.nbytes} bytes, shorter than its header")
    magic, nk, nv = _HEADER.unpack_from(mv, 0)
    if magic != _MAGIC or _HEADER.size + nk + nv != mv.nbytes:
        raise CorruptRecordError(
            f"bad block record framing (magic={bytes(magic)!r}, n_k={nk}, n_v={nv}, total={mv.nbytes})")
    return mv, nk, nv


def unpack_block(buf) -> tuple[Encoded, Encoded]:
    """Inverse of :func:`pack_block`. Raises ``CorruptRecordError`` (a ``ValueError``) on bad framing."""
    from kvtier.compress.record import unpack_record

    mv, nk, _ = _frame(buf)
    k = unpack_record(mv[_HEADER.size:_HEADER.size + nk])
    v = unpack_record(mv[_HEADER.size + nk:])
    return k, v


class BlockDecoder:
    """Block records of integer codecs decoded straight into one ``[2, *shape]`` CPU tensor by the
    compiled kernel, reading the parts in place. Each half is decoded by the codec of its role
    that its own record names (keys and values may carry different codecs).

    The checks are :func:`unpack_block`'s (framing, both headers, both CRCs: corrupt bytes raise
    ``CorruptRecordError``); what it skips is the per-part tensors, the :class:`Encoded` objects
    and the codecs' per-call validation, which cost more than the kernel on a swap-in. A record
    of any other layout (another codec, shape or dtype) gives None: the caller then decodes it
    the general way.
    """

    def __init__(self, kc, vc, shape: tuple[int, ...], dtype: torch.dtype, others: dict | None = None) -> None:
        """``kc``, ``vc``: the K and V codecs; ``others``: more (K, V) pairs by tier codec name."""
        pairs = [(kc, vc), *(others or {}).values()]
        # per role (0: K, 1: V): the record's codec name -> the codec that decodes it; one codec
        # per name and role, since a role's codec arguments follow from its name (config.codec_kwargs)
        self._roles = ({k.name: k for k, _ in pairs}, {v.name: v for _, v in pairs})
        self._shape = tuple(shape)
        self._dtype = dtype
        self._plans: dict = {}  # (role, layout) -> part offsets and kernel arguments, or None
        # the K and V layouts (_layout_of) of the records the compiled call decodes by the batch
        self._known: tuple | None = None
        self._crc = c_address() if cpu.available() else None  # None: every record parsed here
        self._decode_blocks = cpu.block_decoder(self._shape, dtype) if self._crc is not None else None

    def _plan(self, role: int, layout: tuple):
        from kvtier.compress import reference as ref

        name, dtype, shape, params, specs = layout
        codec = self._roles[role].get(name)
        if codec is None:
            return None
        params = dict(params)
        n = params.pop("outliers", 0)  # any count decodes (the record says which)
        base = {k: v for k, v in codec.params.items() if k != "outliers"}
        if dtype != self._dtype or shape != self._shape or params != base:
            return None
        if n and (isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= shape[-1] or codec.axis != "channel"):
            return None  # the general path names what is wrong
        bits = codec.bits
        want = [("q", torch.int8 if bits == 8 else torch.uint8,
                 (*shape[:-1], ref.packed_dim(shape[-1], bits)))]
        sshape = tuple(ref.scale_shape(shape, codec.group_size, codec.axis))
        want.append(("scale", dtype, sshape))
        if bits != 8:
            want.append(("zero", dtype, sshape))
        if n:
            want += [("oidx", torch.uint8, (*shape[:-2], n)), ("oval", dtype, (*shape[:-1], n))]
        if [(name, dt, tuple(dims)) for name, dt, dims, _, _ in specs] != want:
            return None
        offs = [off for *_, off, _ in specs]
        kept = (n, offs[-2], offs[-1]) if n else None
        rot = codec if codec.transform != "none" else None  # rotates the decoded half back
        sbytes = math.prod(sshape) * dtype.itemsize
        return bits, codec.group_size, codec.axis, offs[0], offs[1], offs[2] if bits != 8 else None, kept, rot, sbytes

    def decode(self, buf) -> torch.Tensor | None:
        """``[2, *shape]`` (K, V) of one block record, or None when its layout is not this
        decoder's. Raises ``CorruptRecordError`` on bad framing, a bad header or a CRC mismatch."""
        return self.decode_many([buf])[0]

    def decode_many(self, bufs: list) -> list[torch.Tensor | None]:
        """:meth:`decode` of each of ``bufs``, all decoded into one new ``[n, 2, *shape]``
        tensor (the results are views of it: one allocation and one split for the batch instead
        of two per block, which on a swap-in of small records cost more than the kernel). A
        corrupt record raises, and the batch's tensor is dropped with it.

        Records of the layout this decoder met last (the same K and V headers byte for byte) are
        checked and decoded by one compiled call for the batch (``cpu.block_decoder``: framing,
        header bytes, both CRCs, then the kernel); the others are parsed one by one here."""
        n = len(bufs)
        if n == 0:
            return []
        shape, dtype = self._shape, self._dtype
        out = torch.empty((n, 2, *shape) if n > 1 else (2, *shape), dtype=dtype)
        rest = self._decode_known(bufs, out) if self._known is not None else range(n)
        blocks = list(out.unbind(0)) if n > 1 else [out]  # a lone block owns its tensor
        if rest:
            which: list[bool] = [True] * n
            self._decode_each(bufs, rest, out.view(n, 2, *shape), which)
            return [b if ok else None for b, ok in zip(blocks, which)]
        return blocks

    def _decode_known(self, bufs: list, out: torch.Tensor):
        """The records of the known layout decoded into ``out`` in one compiled call; returns the
        positions of the others (another layout), left for :meth:`_decode_each`. Raises
        ``CorruptRecordError`` when a record of the known layout fails a CRC."""
        status = self._decode_known_to(bufs, out.data_ptr())
        return [i for i, s in enumerate(status) if s] if any(status) else []

    def decode_into(self, bufs: list, pool: torch.Tensor, slot_axis: int, slots: list[int]) -> list[bool]:
        """Records of the known layout decoded straight into slots of a pool (``pool``: the
        contiguous CPU storage of this decoder's dtype, ``[2, *B, num_slots, T, D]`` with the slot
        index at ``slot_axis`` = 1 + len(B)); record ``i`` into slot ``slots[i]``. Returns per
        record whether it was decoded (False: another layout, or no layout known yet: nothing
        written there). Raises ``CorruptRecordError`` when a record fails a CRC (then nothing of
        the batch is written)."""
        n = len(bufs)
        shape = self._shape
        if self._known is None or n == 0:
            return [False] * n
        assert (pool.dtype == self._dtype and pool.device.type == "cpu" and pool.is_contiguous()
                and slot_axis == len(shape) - 1 and pool.dim() == len(shape) + 2), \
            f"pool {pool.dtype} {tuple(pool.shape)} slot_axis {slot_axis} for blocks of {shape}"
        *lead, t, d = shape
        heads = 1
        for x in lead:
            heads *= x
        num_slots = pool.shape[slot_axis]
        strides = (t * d, heads * num_slots * t * d, num_slots * t * d)  # per slot, half, head
        status = self._decode_known_to(bufs, pool.data_ptr(), (ctypes.c_int64 * n)(*slots), strides)
        return [s == 0 for s in status]

    def _decode_known_to(self, bufs: list, out: int, dst=None, strides=None) -> bytes:
        """One compiled call over ``bufs`` (``cpu.block_decoder``: into the buffer at address
        ``out``, rows ``dst`` at ``strides`` if given); the per-record status (0: decoded)."""
        from kvtier.compress.record import CorruptRecordError

        n = len(bufs)
        # the offsets and lengths as one ctypes array, the records joined into one bytes object
        # (ctypes passes both by address): a handful of Python operations for the batch, where
        # numpy arrays and their .ctypes addresses cost more than the kernel on a small swap-in
        meta = (ctypes.c_int64 * (2 * n))()
        o = 0
        for i, b in enumerate(bufs):
            size = b.nbytes if isinstance(b, memoryview) else len(b)
            meta[i] = o
            meta[n + i] = size
            o += size
        status = (ctypes.c_int8 * n)()
        k, v = self._known
        bad = self._decode_blocks(b"".join(bufs), meta, ctypes.byref(meta, 8 * n), n, k[:3], v[:3], self._crc,
                                  out, status, dst, strides)
        if bad < 0:
            raise MemoryError("kvt_decode_blocks: out of memory")
        if bad:
            raise CorruptRecordError(f"{bad} of {n} block records failed a CRC-32 check")
        return bytes(status)

    def _decode_each(self, bufs: list, todo: list[int], out: torch.Tensor, which: list[bool]) -> None:
        """The records ``todo`` of ``bufs`` parsed here and decoded into ``out[i]`` ``[n, 2,
        *shape]``; ``which[i]`` set False for those of a layout this decoder does not decode.
        Every one is checked before any is decoded."""

        jobs = []  # per decodable record: (position, buffer address, K job, V job)
        keep = []  # the memoryviews whose addresses are used, alive until the kernels ran
        item = self._dtype.itemsize
        learned = None
        for i in todo:
            got = self._check(bufs[i], item)
            if got is None:
                which[i] = False
                continue
            keep.append(got[0])
            jobs.append((i, *got[1:4]))
            learned = got[4] or learned
        shape, dtype = self._shape, self._dtype
        for i, base, kjob, vjob in jobs:
            for half, (payload, (bits, group, axis, q, s, z, kept, rot, _)) in zip(out[i].unbind(0), (kjob, vjob)):
                p = base + payload
                cpu.dequantize_ptrs(p + q, p + s, None if z is None else p + z, bits, group, axis, shape, dtype, half)
                if kept is not None:
                    self._merge_kept(p, kept, half)
                if rot is not None:
                    rot.untransform(half)  # in place: halves are contiguous
        del keep
        if learned is not None and self._crc is not None and len(jobs) * 2 > len(bufs):
            # most of this batch was of a layout the compiled call can take: the next batches'
            # records are most likely of it too
            self._known = learned

    def _check(self, buf, item: int):
        """(memoryview, buffer address, K job, V job, layout) of a record this decoder can decode
        in place, a job being (payload offset, plan) and layout what the compiled call needs to
        know the record's layout (None where it takes no such record: kept channels);
        None for another layout. Raises ``CorruptRecordError`` as :meth:`decode`."""
        from kvtier.compress.record import check_record

        mv, nk, nv = _frame(buf)
        jobs = []
        for role, start, n in ((0, _HEADER.size, nk), (1, _HEADER.size + nk, nv)):
            layout, header_len, _ = check_record(mv[start:start + n])
            key = (role, layout)
            plan = self._plans.get(key, False)
            if plan is False:
                plan = self._plans[key] = self._plan(role, layout)
            if plan is None:
                return None
            jobs.append((start + header_len, plan))
        base = np.frombuffer(mv, dtype=np.uint8).ctypes.data  # the caller keeps mv alive
        for payload, (_, _, _, _, s, z, _, _, _) in jobs:  # scales/zeros unaligned for their dtype (a v1
            if (base + payload + s) % item or (z is not None and (base + payload + z) % item):
                return None                       # header): the general path copies them
        known = None
        # the compiled call rotates back the Hadamard transform, and merges no kept channels
        if all(plan[6] is None and (plan[7] is None or plan[7].transform == "hadamard") for _, plan in jobs):
            d = self._shape[-1]
            known = tuple(self._layout_of(mv, start, payload, n, plan, d) for (payload, plan), start, n in
                          zip(jobs, (_HEADER.size, _HEADER.size + nk), (nk, nv)))
        return mv, base, jobs[0], jobs[1], known

    @staticmethod
    def _layout_of(mv: memoryview, start: int, payload: int, n: int, plan: tuple, d: int) -> tuple:
        """One half's (header bytes, record length, plan address, plan array) for the compiled
        call: every record of this layout starts with these header bytes. ``d``: head_dim (a
        Hadamard-rotated half is rotated back in blocks of ``hadamard_block(d)`` channels)."""
        from kvtier.compress.rotation import hadamard_block

        bits, group, axis, q, s, z, _, rot, sbytes = plan
        rb = 0 if rot is None else hadamard_block(d)
        arr = np.array([bits, group, 0 if axis == "token" else 1, q, s, -1 if z is None else z, sbytes, rb], np.int64)
        return bytes(mv[start:payload]), n, arr.ctypes.data, arr

    def _merge_kept(self, p: int, kept: tuple, half: torch.Tensor) -> None:
        """Write a record's exactly kept channels (payload at address ``p``) over their
        dequantized values in ``half`` (byte copies: any alignment)."""
        from kvtier.compress.record import CorruptRecordError

        n, io, vo = kept
        if not cpu.merge_kept_ptrs(p + io, p + vo, self._shape, n, self._dtype, half):
            raise CorruptRecordError(f"block record keeps a channel index >= head_dim {self._shape[-1]}")
