"""A config's sizes against one model's KV shape: how many bytes a block record takes in each
tier, and whether the L1/L2/L3 sizes the user chose can hold this model on this machine.

Lives beside the layout because it needs what the config does not know: the model's shape and
the tiers' real record framing. Every error names the user's field and the bound in bytes.
"""
from __future__ import annotations

import torch

from kvtier.config import KVTierConfig
from kvtier.configcheck import Derived, device_memory, physical_memory
from kvtier.tiers.disk import SEG_HEADER_BYTES, record_size
from kvtier.tiers.host import HostTier

from .blockrecord import pack_block


def block_record_bytes(cfg: KVTierConfig, num_layers: int, kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> tuple[int, int]:
    """(L2 ring bytes, L3 segment bytes) one block of this model takes at most, headers included.

    Measured by encoding one block with the tiers' real codecs, as the store frames it.
    """
    # the longest key the store writes: content-addressed "m<32 hex>/<layer>/<32 hex>"
    key = f"m{'0' * 32}/{num_layers - 1}/{'0' * 32}"

    def block(name: str) -> int:
        return len(pack_block(*encoded_block(cfg, name, kv_heads, head_dim, dtype)))

    l2 = HostTier.record_bytes(key, block(cfg.host_codec))
    l3 = SEG_HEADER_BYTES + record_size(len(key), block(cfg.disk_codec))
    return l2, l3


def encoded_block(cfg: KVTierConfig, name: str, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple:
    """(K, V) encodings of one block of one layer in tier codec ``name``, as the store encodes
    it: a 16-bit codec follows the KV dtype, and each role is stored in its own codec
    (``KVTierConfig.codec_pair``: ``key_codec``/``value_codec`` in place of ``codec``)."""
    x = torch.zeros(kv_heads, cfg.block_tokens, head_dim, dtype=dtype)  # [kv_heads, block_tokens, head_dim]
    if name in ("fp16", "bf16") and dtype != torch.float32:
        name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]  # as the store's layout renames it
    kc, vc = cfg.codec_pair(name)
    return kc.encode(x), vc.encode(x)


def check_model(cfg: KVTierConfig, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device=None, machine: bool = True) -> None:
    """Check ``cfg``'s sizes against one model's KV shape, before anything is allocated.

    Raises ValueError naming the user's field and the bound in bytes for this model: L1
    (``device_tokens``/``device_bytes`` x ``max_sequences``) that the device cannot hold,
    ``host_bytes`` beyond this machine's RAM or below one block record,
    ``disk_segment_bytes`` below one L3 record, ``disk_bytes`` below the two segments L3
    needs to reclaim space by compaction.

    Args:
        dtype: the KV dtype (a torch dtype).
        device: where L1 lives (default CPU).
        machine: also check against this machine's memory (False: a plan for another one).
    """
    device = torch.device(device if device is not None else "cpu")
    elem = torch.empty((), dtype=dtype).element_size()
    bt = cfg.block_tokens
    slot_bytes = 2 * kv_heads * bt * head_dim * elem  # one block, K and V, full precision
    importance = cfg.precision == "importance"
    int2 = "int2" in (cfg.role_codec(cfg.host_codec, "key"), cfg.role_codec(cfg.disk_codec, "key")) or (importance and (
        cfg.heavy_codec == "int2" or (cfg.cold_codec == "int2" and cfg.cold_key_outliers is None)))
    if int2 and cfg.key_axis == "channel" and cfg.int2_key_outliers > head_dim:
        raise ValueError(f"int2_key_outliers must be <= head_dim ({head_dim}) for this model's int2 "
                         f"keys; got {cfg.int2_key_outliers}")
    if importance and cfg.key_axis == "channel" and (cfg.cold_key_outliers or 0) > head_dim:
        raise ValueError(f"cold_key_outliers must be <= head_dim ({head_dim}) for this model's "
                         f"{cfg.cold_codec} keys; got {cfg.cold_key_outliers}")
    if cfg.attention == "sparse" and cfg.digest_dtype == "int4" and head_dim % 2 and not isinstance(
            cfg.digest_dtype, Derived):
        # two channels a byte; the derived default falls back to int8 instead (layout.py)
        raise ValueError(f"digest_dtype='int4' needs an even head_dim (two channels a byte); this model's "
                         f"is {head_dim}: use digest_dtype='int8'")
    if machine:
        _check_memory(cfg, slot_bytes, num_layers, device)
    l2, l3 = block_record_bytes(cfg, num_layers, kv_heads, head_dim, dtype)
    if cfg.host_bytes < l2:
        raise ValueError(f"host_bytes must hold at least one block: >= {l2:,} bytes for this model "
                         f"(a {cfg.host_codec} block of {bt} tokens, {kv_heads} kv heads x "
                         f"head_dim {head_dim}, K and V); got {cfg.host_bytes:,}")
    if cfg.disk_path is None:
        return
    if cfg.disk_segment_bytes < l3:
        if cfg.is_derived("disk_segment_bytes"):  # half of disk_bytes: disk_bytes is the cause
            raise ValueError(f"disk_bytes must hold two L3 segments of at least one block each: "
                             f">= {2 * -(-l3 // 4096) * 4096:,} bytes for this model (a {cfg.disk_codec} "
                             f"block record is {l3:,} bytes with the segment header); got {cfg.disk_bytes:,}")
        raise ValueError(f"disk_segment_bytes must hold at least one block: >= {l3:,} bytes for "
                         f"this model (a {cfg.disk_codec} block record and the segment header); "
                         f"got {cfg.disk_segment_bytes:,}")
    if cfg.disk_bytes < 2 * cfg.disk_segment_bytes:
        raise ValueError(f"disk_bytes must hold at least two segments (>= 2 x disk_segment_bytes = "
                         f"{2 * cfg.disk_segment_bytes:,} bytes): L3 reclaims space by compacting "
                         f"one segment into another; got {cfg.disk_bytes:,}")


def _check_memory(cfg: KVTierConfig, slot_bytes: int, num_layers: int, device: torch.device) -> None:
    """L1 against the device's memory, L2 against this machine's RAM."""
    bt = cfg.block_tokens
    ram = physical_memory()
    if ram and cfg.host_bytes > ram:
        raise ValueError(f"host_bytes must be at most this machine's memory ({ram:,} bytes): L2 is a "
                         f"DRAM ring; got {cfg.host_bytes:,}")
    room = device_memory(device)
    if not room:
        return
    if cfg.device_bytes is not None:
        if cfg.device_bytes > room:
            raise ValueError(f"device_bytes must fit the L1 device ({device}: {room:,} bytes); "
                             f"got {cfg.device_bytes:,}")
        return
    device_blocks = cfg.device_tokens // bt
    # the store adds up to device_blocks - 1 scratch slots per sequence (a selection's swap-ins)
    l1 = slot_bytes * cfg.max_sequences * (num_layers * device_blocks + max(1, device_blocks - 1))
    if l1 > room:
        most = room // (slot_bytes * cfg.max_sequences * (num_layers + 1)) * bt
        raise ValueError(
            f"device_tokens x max_sequences must fit the L1 device ({device}: {room:,} bytes): "
            f"device_tokens={cfg.device_tokens:,} with max_sequences={cfg.max_sequences} needs "
            f"{l1:,} bytes for this model ({slot_bytes * num_layers // bt:,} bytes per token "
            f"and sequence); at most about device_tokens={max(bt, most):,}")
