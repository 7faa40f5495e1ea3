"""Block I/O: one block's K and V to a tier record and back.

The codecs of each tier (keys grouped per channel, values per token: KIVI), the compiled
in-place decoders of integer records (``blockrecord.BlockDecoder``, CPU), and the lossless byte
stage (lz4 | zstd) on records bound for L3/L4, and for L2 when ``byte_stage_l2``. The stage counts
what it saw here (``stage_in``/``stage_out``); the encodings count raw and encoded bytes.
"""
from __future__ import annotations

import torch

from kvtier.config import KVTierConfig

from .blockrecord import BlockDecoder, pack_block, unpack_block
from .layout import Layout
from .stats import Counters

_CPU = torch.device("cpu")


class BlockIO:
    def __init__(self, cfg: KVTierConfig, layout: Layout, counters: Counters) -> None:
        from kvtier.compress import cpu as cpu_kernels
        from kvtier.compress.bytestage import ByteStage
        from kvtier.compress.codecs import IntCodec

        pair = cfg.codec_pair
        self.layout = layout
        self.counters = counters
        self.codecs = {"l2": pair(layout.host_codec), "l3": pair(layout.disk_codec)}
        # (K, V) codecs by tier codec name (with key_codec/value_codec the two differ), for
        # precision="importance", whose records of one tier may carry different codecs
        self.by_name = {layout.host_codec: self.codecs["l2"], layout.disk_codec: self.codecs["l3"]}
        if layout.precision is not None:
            for name in layout.precision.codecs:
                self.by_name.setdefault(name, pair(name))
        # per role: a record's codec name -> its decoder; each half of a block record is decoded
        # by the codec its own header names
        self.by_role = ({k.name: k for k, _ in self.by_name.values()}, {v.name: v for _, v in self.by_name.values()})
        shape = (layout.kv_heads, layout.block_tokens, layout.head_dim)
        fast = {name: cs for name, cs in self.by_name.items() if all(isinstance(c, IntCodec) for c in cs)}
        self.fast_decoder = None
        if fast and layout.device.type == "cpu" and cpu_kernels.available():
            first, *rest = fast
            self.fast_decoder = BlockDecoder(*fast[first], shape, layout.dtype, {n: fast[n] for n in rest})
        self.stage = ByteStage(cfg.byte_stage, cfg.byte_stage_min_saving)

    def codec_identity(self) -> dict:
        """Every codec a record of this store may carry, by tier codec name, with its K and V
        codecs' names and parameters as the codecs state them (key transform included): what a
        key must name so that records of other encodings (another role's codec) miss."""
        return {name: {"key": [k.name, k.params], "value": [v.name, v.params]}
                for name, (k, v) in sorted(self.by_name.items())}

    # -- encode --------------------------------------------------------------------------------

    def encode_pair(self, block: torch.Tensor, tier: str, codec: str | None = None):
        """(K, V) encodings of ``block`` [2, kv_heads, block_tokens, head_dim] in ``codec`` (one
        of this store's, counted as ``tier``'s), by default ``tier``'s codec, on the host
        (pinned, copy still in flight, when the block is on a CUDA device)."""
        kc, vc = self.codecs[tier] if codec is None else self.by_name[codec]
        ek = kc.encode(block[0])  # [kv_heads, block_tokens, head_dim]
        ev = vc.encode(block[1])
        if ek.device.type != "cpu":
            ek, ev = _to_pinned(ek), _to_pinned(ev)
        self.counters.add(**{"raw_" + tier: block.numel() * block.element_size(),
                             "enc_" + tier: ek.nbytes + ev.nbytes})
        return ek, ev

    def encode(self, block: torch.Tensor, tier: str) -> bytes:
        """One block as one record (host tensors only: no pending copies)."""
        assert block.device.type == "cpu", "records are framed from host tensors"
        return pack_block(*self.encode_pair(block, tier))

    def pack(self, raw: bytes) -> bytes:
        """A record through the byte stage (counted)."""
        packed = self.stage.pack(raw)
        self.counters.add(stage_in=len(raw), stage_out=len(packed))
        return packed

    def l2_record(self, raw: bytes) -> bytes:
        """A block record as L2 holds it: through the byte stage when ``byte_stage_l2``."""
        return self.pack(raw) if self.layout.l2_staged else raw

    def disk_record(self, block: torch.Tensor) -> bytes:
        """``block`` [2, kv_heads, block_tokens, head_dim] as L3/L4 hold it (disk codec, stage)."""
        return self.pack(self.encode(block.to("cpu"), "l3"))

    def spill_record(self, l2_value) -> bytes:
        """An L2 value as L3 holds it: unstaged, transcoded to the disk codec when the codecs
        differ, and staged again; as it is when it already went through the stage L3 uses."""
        lay = self.layout
        raw = bytes(l2_value)
        if lay.l2_staged and not lay.transcode:
            return raw
        if lay.l2_staged:
            raw = self.stage.unpack(raw)
        if lay.transcode:
            raw = self.encode(self.decode(raw, "l2", _CPU), "l3")
        return self.pack(raw)

    # -- decode --------------------------------------------------------------------------------

    def decode(self, buf, tier: str, device: torch.device) -> torch.Tensor:
        """Record -> [2, kv_heads, block_tokens, head_dim] in the store dtype on ``device``."""
        if device.type == "cpu" and self.fast_decoder is not None:
            out = self.fast_decoder.decode(buf)  # CRC-checked, parts read in place
            if out is not None:
                return out
        ek, ev = unpack_block(buf)
        kc, vc = self.codecs[tier]
        # a record stored in another of this store's codecs decodes by its own; an unknown name
        # reaches the tier's codec, which refuses it (ValueError)
        kc, vc = self.by_role[0].get(ek.codec, kc), self.by_role[1].get(ev.codec, vc)
        k = kc.decode(ek, device=device)
        v = vc.decode(ev, device=device)
        return torch.stack((k, v)).to(self.layout.dtype)

    def decode_stored(self, value, tier: str, device: torch.device) -> torch.Tensor:
        """A value as ``tier`` (l2 or l3; L4 holds L3's records) stores it, decoded on ``device``."""
        staged = tier == "l3" or self.layout.l2_staged
        return self.decode(self.stage.unpack(value) if staged else value, tier, device)

    def decode_stored_many(self, items: list[tuple], device: torch.device) -> list[torch.Tensor]:
        """:meth:`decode_stored` of each (value, tier) of ``items``; on CPU the in-place decoder
        decodes the batch into one tensor (the results are views of it: callers that hold one
        for long copy it, so as not to keep the whole batch alive)."""
        if device.type != "cpu" or self.fast_decoder is None or len(items) < 2:
            return [self.decode_stored(v, tier, device) for v, tier in items]
        bufs = [self.stage.unpack(v) if tier == "l3" or self.layout.l2_staged else v for v, tier in items]
        out = self.fast_decoder.decode_many(bufs)
        for i, d in enumerate(out):
            if d is None:  # another layout: the general path
                out[i] = self.decode(bufs[i], items[i][1], device)
        return out

    def try_decode_l3(self, value, device: torch.device | None = None) -> torch.Tensor | None:
        """An L3/L4 value decoded on ``device`` (default the store's); None if absent, foreign
        or corrupt."""
        return self.try_decode_stored(value, "l3", self.layout.device if device is None else device)

    def try_decode_stored(self, value, tier: str, device: torch.device) -> torch.Tensor | None:
        """:meth:`decode_stored`, None if ``value`` is absent, foreign or corrupt."""
        if value is None:
            return None
        try:
            return self.decode_stored(value, tier, device)
        except ValueError:  # foreign or corrupt bytes are a miss, never wrong data
            return None

    def checked_raw(self, value, staged: bool) -> bytes:
        """A stored value as its block record, framing and both CRCs checked (corrupt bytes raise
        ``CorruptRecordError``, a ValueError)."""
        raw = self.stage.unpack(value) if staged else bytes(value)
        unpack_block(raw)
        return raw


def _to_pinned(enc):
    """A copy of ``enc`` in pinned host memory, enqueued on the current stream (not yet complete)."""
    from kvtier.compress.base import Encoded

    parts = {}
    for name, t in enc.parts.items():
        dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        dst.copy_(t, non_blocking=True)
        parts[name] = dst
    return Encoded(enc.codec, dict(enc.params), tuple(enc.shape), enc.dtype, parts)
