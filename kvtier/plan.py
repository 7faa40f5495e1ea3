"""KV size per token and per sequence, and recommended tier sizes (what ``kvtier plan`` prints).

Size of full-precision KV:

    bytes = 2 (K and V) x layers x kv_heads x head_dim x bytes_per_element x tokens

The codec's size per token is measured, not assumed: one block is encoded as a store of the
printed config encodes it (the keys in ``key_codec``, the values in ``value_codec`` where set;
scales and zeros included) and its ``nbytes`` divided by the block's tokens.

Sizing (the usual serving practice: HBM:DRAM about 1:4 to 1:8, SSD as backstop):

```
 T  = concurrency x avg_seq_len              tokens live on average
 L1 = h tokens at full precision              h: the L1 (device) share
 L2 = (T - h) tokens encoded                  the rest of the average working set
 L2 bytes = ratio x L1 bytes  ->  h = T * bc / (ratio * bf + bc)   (bf, bc: bytes/token fp, codec)
 L3 = concurrency x max_seq_len encoded       every sequence at its longest (lz4 assumed 1.0)
```
The tier sizes printed are what a store built from the printed config allocates: L1 its pool
(the regions and the scratch slots), L2 ``host_bytes`` (the L2 figure above in whole block
records with their headers, at least one), L3 ``disk_bytes`` (whole segments, at least two);
``needed`` keeps the figures above.
``ratio`` defaults to 6 (the middle of 1:4-1:8). With ``--hbm-bytes`` the L1 size is given and the
ratio follows from it; a ratio outside 4-8 is reported as such.

All byte counts are exact integers (rational arithmetic). The printed ``KVTierConfig`` is built
and checked against the model's shape before it is printed: ``host_bytes`` holds at least one
block record, L3 at least two segments of at least one record each, so it is a configuration
``KVTierConfig`` accepts (on a machine with the planned memory).

The sizing table (``sizing_table``: KV per sequence at 4k / 32k / 128k tokens, and for
``--concurrency`` of them) is printed for the model: LLaMA-2-70B as the common back-of-envelope
count has it (80 layers, hidden 8192, fp16, one KV head per query head: ``--layers 80 --hidden-size 8192 --heads 64``) gives 10 / 80 / 320 GiB per
sequence and 3,200 GiB for 10 x 128k; with its real 8 KV heads (GQA, ``--kv-heads 8``) each
figure is 8x smaller.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any, NamedTuple

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp16": 2, "bf16": 2, "fp32": 4}
#: the KV dtype names make_plan takes
DTYPES = tuple(sorted(_DTYPE_BYTES))
_CANONICAL = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "fp16": "float16",
              "bf16": "bfloat16", "fp32": "float32"}
# the sequence lengths of the sizing table (4k, 32k, 128k)
_TABLE_LENGTHS = (4096, 32768, 131072)


def codec_bytes_per_block(codec: str, dtype: str, kv_heads: int, head_dim: int, block_tokens: int,
                          group_size: int, key_codec: str | None = None, value_codec: str | None = None) -> int:
    """Measured encoded bytes of one block of one layer, K and V (scales and zeros included)."""
    roles = _role_blocks(codec, dtype, kv_heads, head_dim, block_tokens, group_size, key_codec, value_codec)
    return sum(n for _, n in roles.values())


def _role_blocks(codec, dtype, kv_heads, head_dim, block_tokens, group_size, key_codec, value_codec) -> dict:
    """{"key": (codec, bytes), "value": (codec, bytes)}: each role's half of one block of one
    layer as a store of this config encodes it (``kvtier.store.sizing.encoded_block``: the
    config's own role rules), the codec as the encoding names it."""
    from kvtier.config import KVTierConfig
    from kvtier.store.sizing import encoded_block

    cfg = KVTierConfig(block_tokens=block_tokens, device_tokens=block_tokens, codec=codec, group_size=group_size,
                       key_codec=key_codec, value_codec=value_codec)
    k, v = encoded_block(cfg, codec, kv_heads, head_dim, _torch_dtype(dtype))
    return {"key": (k.codec, k.nbytes), "value": (v.codec, v.nbytes)}


def codec_bytes_per_token(codec: str, kv_heads: int, head_dim: int, block_tokens: int, group_size: int,
                          layers: int, dtype: str = "float16", key_codec: str | None = None,
                          value_codec: str | None = None) -> float:
    """Measured encoded bytes per token (all layers, K and V) of ``codec`` (keys in ``key_codec``,
    values in ``value_codec`` where set)."""
    return codec_bytes_per_block(codec, dtype, kv_heads, head_dim, block_tokens, group_size, key_codec,
                                 value_codec) * layers / block_tokens


def _ceil(x: Fraction) -> int:
    return -(-x.numerator // x.denominator)


def make_plan(layers: int, kv_heads: int, head_dim: int, dtype: str, concurrency: int, avg_seq_len: int,
              max_seq_len: int, codec: str, group_size: int = 32, block_tokens: int = 64,
              ratio: float = 6.0, hbm_bytes: int | None = None, heads: int | None = None,
              disk_path: str = "kvtier-cache", key_codec: str | None = None,
              value_codec: str | None = None) -> dict:
    """The plan as a dict (see the module docstring for the arithmetic). Byte counts are exact
    integers; the ``config`` entry is checked by ``KVTierConfig`` (and its sizes against this
    model's shape) before it is returned.

    Args:
        heads: query heads, when known: ``kv_heads < heads`` is grouped-query attention and the
            plan states how much smaller the KV is than with one KV head per query head.
        key_codec, value_codec: the keys' / values' own codec where a tier stores ``codec``
            (None: ``codec``), as ``KVTierConfig``'s fields of those names (e.g. ``int4`` keys
            with ``int2`` values); each role is measured in its own codec.
    """
    from kvtier.config import CODECS, GROUP_SIZES, KVTierConfig
    from kvtier.configcheck import CHOICES
    from kvtier.store.layout import pool_slots
    from kvtier.store.sizing import check_model

    for name, v in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                    ("concurrency", concurrency), ("avg_seq_len", avg_seq_len), ("max_seq_len", max_seq_len),
                    ("block_tokens", block_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1; got {v!r}")
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < kv_heads
                              or heads % kv_heads):
        raise ValueError(f"heads must be a multiple of kv_heads ({kv_heads}); got {heads!r}")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}; got {dtype!r}")
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {', '.join(CODECS)}; got {codec!r}")
    for name, v in (("key_codec", key_codec), ("value_codec", value_codec)):
        if v is not None and v not in CHOICES[name]:
            raise ValueError(f"{name} must be one of {', '.join(CHOICES[name])} (or None: codec); got {v!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}; got {group_size!r}")
    if avg_seq_len > max_seq_len:
        raise ValueError(f"avg_seq_len must be <= max_seq_len ({max_seq_len}); got {avg_seq_len}")
    if not 1.0 <= ratio <= 64.0:
        raise ValueError(f"ratio must be in [1, 64] (4-8 recommended); got {ratio}")
    dtype = _CANONICAL[dtype]
    bf = 2 * layers * kv_heads * head_dim * _DTYPE_BYTES[dtype]  # bytes per token, full precision
    roles = _role_blocks(codec, dtype, kv_heads, head_dim, block_tokens, group_size, key_codec, value_codec)
    per_block = sum(n for _, n in roles.values()) * layers
    bc = Fraction(per_block, block_tokens)  # encoded bytes per token, exact
    live = concurrency * avg_seq_len
    if hbm_bytes is None:
        l1_tokens = live * bc / (Fraction(ratio) * bf + bc)
    else:
        if hbm_bytes < concurrency * block_tokens * bf:
            raise ValueError(f"hbm_bytes must hold one block per sequence (>= {concurrency * block_tokens * bf:,} "
                             f"bytes here); got {hbm_bytes:,}")
        l1_tokens = Fraction(min(live, hbm_bytes // bf))
    # per sequence, whole blocks, at least one and at most what the longest sequence needs
    device_tokens = int(l1_tokens / concurrency) // block_tokens * block_tokens
    device_tokens = max(block_tokens, min(device_tokens, _ceil(Fraction(max_seq_len, block_tokens)) * block_tokens))
    need_l2 = _ceil(max(Fraction(0), (live - device_tokens * concurrency) * bc))
    need_l3 = _ceil(concurrency * max_seq_len * bc)
    try:
        cfg, records = _config(layers, kv_heads, head_dim, dtype, block_tokens, device_tokens, concurrency,
                      max(0, live - device_tokens * concurrency), need_l3, codec, group_size, disk_path,
                      key_codec, value_codec)
        check_model(KVTierConfig.from_dict(cfg), layers, kv_heads, head_dim, _torch_dtype(dtype), machine=False)
    except ValueError as e:
        raise ValueError(f"this workload needs a configuration KVTierConfig does not accept ({e}); "
                         f"lower --max-seq-len, --avg-seq-len or --concurrency") from None
    # what a store with this config allocates (L1: its pool, scratch slots included; L2: the
    # ring; L3: the bound its files grow to), floors included: at least one block record in L2,
    # two segments in L3
    l1 = pool_slots(device_tokens // block_tokens, concurrency, layers) * (bf // layers) * block_tokens
    l2, l3 = cfg["host_bytes"], cfg["disk_bytes"]
    achieved = Fraction(l2, l1)
    out = {
        "model": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype},
        "workload": {"concurrency": concurrency, "avg_seq_len": avg_seq_len, "max_seq_len": max_seq_len},
        "codec": codec,
        # what each role is stored in below L1 and its encoded bytes per block (all layers)
        "roles": {r: {"codec": c, "bytes_per_block": n * layers} for r, (c, n) in roles.items()},
        "bytes_per_token": {"full": bf, "codec": round(float(bc), 3), "codec_per_block": per_block,
                            "codec_ratio": round(float(bf / bc), 3)},
        "bytes_per_sequence": {"avg_full": bf * avg_seq_len, "max_full": bf * max_seq_len,
                               "avg_codec": _ceil(bc * avg_seq_len), "max_codec": _ceil(bc * max_seq_len)},
        "all_sequences_full": {"avg": bf * live, "max": bf * concurrency * max_seq_len},
        "sizing_table": {str(n): {"sequence": bf * n, "all_sequences": bf * n * concurrency}
                       for n in _TABLE_LENGTHS},
        "tiers": {"l1_hbm_bytes": l1, "l2_dram_bytes": l2, "l3_ssd_bytes": l3,
                  "dram_to_hbm": round(float(achieved), 3), "ratio_in_range": 4 <= achieved <= 8},
        # the encoded KV the workload puts past L1 (L2: the average working set; L3: every
        # sequence at its longest): the tiers above are these rounded up to what a store allocates
        "needed": {"l2_dram_bytes": need_l2, "l3_ssd_bytes": need_l3},
        # one block of one layer as an L2 ring record / an L3 segment record, headers included
        # (kvtier.store.sizing.block_record_bytes: the bound the store checks its sizes with)
        "record_bytes": dict(zip(("l2", "l3"), records)),
        "config": cfg,
    }
    out["sparse"] = _sparse_plan(layers, kv_heads, head_dim, dtype, concurrency, max_seq_len, device_tokens,
                                 block_tokens, cfg, bf)
    if heads is not None:
        out["gqa"] = {"heads": heads, "kv_heads": kv_heads, "mha_bytes_per_token": bf * heads // kv_heads,
                      "reduction": heads // kv_heads}
    return out


#: L1 share of the context of the sparse alternative: the share the demo (RULER NIAH at 8k) and
#: the NIAH family at 32k measured (docs/results/2026-12-05-ruler-32k.md: 1.02x full attention over 16 samples)
SPARSE_SHARE = Fraction(3, 100)


class _Resolved(NamedTuple):
    """One sparse config of :func:`_sparse_plan` as a store resolves it for the workload."""
    fields: dict          # the KVTierConfig fields (preset included)
    cfg: Any              # the KVTierConfig
    layout: Any           # its Layout for the model shape
    l1_kv: int            # the L1 pool's bytes (every sequence's region, scratch slots included)
    digest_used: int      # digest rows of every sequence's sealed blocks at its longest, all layers
    digest_held: int      # the rows the tables then hold (grown room included)


def _sparse_plan(layers, kv_heads, head_dim, dtype, concurrency, max_seq_len, dense_l1, dense_block, dense_cfg,
                 bf) -> dict:
    """The long-context preset for this workload: L1 = 3% of the longest sequence (whole 16-token
    blocks, at least four), its L1 bytes: the pool and the digests of every sealed block (per kv
    head and layer, with the defaults: a key row per token as 4-bit codes with a float16 scale
    and zero per channel and block, and an int8 value mean with its float32 scale per
    ``value_digest_tokens`` tokens), both
    from the layout a store of that config resolves, and whether dense
    attention would read most of each sequence back every step (L1 under a quarter of the
    longest sequence). With the default key row per token, ``pairs_same_l1``: the largest
    whole-block budget whose pool fits the same L1 bytes beside key means per pair of tokens
    (``digest_tokens=2``), capped at the longest sequence."""
    from kvtier.config import KVTierConfig, lossless_codec
    from kvtier.presets import preset_fields
    from kvtier.store.layout import Layout, pool_slots

    probe = KVTierConfig.preset("long-context")
    bt = probe.block_tokens
    l1_tokens = max(4 * bt, int(max_seq_len * SPARSE_SHARE) // bt * bt)

    def resolve(device_tokens: int, **extra) -> _Resolved:
        fields = preset_fields("long-context", {
            "device_tokens": device_tokens, "max_sequences": concurrency, "host_bytes": dense_cfg["host_bytes"],
            "disk_path": dense_cfg["disk_path"], "disk_bytes": dense_cfg["disk_bytes"],
            "disk_segment_bytes": dense_cfg["disk_segment_bytes"], "codec": dense_cfg["codec"],
            "group_size": dense_cfg["group_size"], **extra,
            **{k: dense_cfg[k] for k in ("key_codec", "value_codec") if k in dense_cfg}}, lossless_codec)
        cfg = KVTierConfig(**fields)
        lay = Layout.resolve(cfg, layers, kv_heads, head_dim, _torch_dtype(dtype), "cpu", machine=False)
        l1_kv = pool_slots(lay.device_blocks, concurrency, layers) * lay.slot_bytes
        # every sequence at its longest: the digest rows of its sealed blocks, and the rows its
        # tables hold (a table grows by a quarter at a time), in every layer
        used, held = (n * layers * concurrency for n in lay.digest_bytes(max_seq_len))
        return _Resolved(fields, cfg, lay, l1_kv, used, held)

    fields, cfg, lay, l1_kv, used, held = resolve(l1_tokens)
    plan = {
        "recommended": dense_l1 * 4 < max_seq_len,
        "share": float(SPARSE_SHARE),
        "device_tokens": l1_tokens,
        "l1_bytes": l1_kv + held,
        "l1_kv_bytes": l1_kv,
        "l1_digest_bytes": held,
        "l1_digest_used_bytes": used,
        "digest_share": round(held / (l1_kv + held), 3),
        "digest_tokens": cfg.digest_tokens,
        "digest_dtype": cfg.digest_dtype,
        "value_digest_tokens": cfg.value_digest_tokens if cfg.rest_attention == "estimate" else None,
        "digest_bytes_per_token": round(lay.digest_row_bytes * layers / bt, 3),
        "config": {"preset": "long-context", **{k: v for k, v in fields.items()
                                                 if k not in ("attention", "policy")}},
    }
    if cfg.digest_tokens == 1 and bt % 2 == 0:
        # The same L1 bytes with a key mean per pair of tokens: the rows it does not keep hold KV
        # instead, a larger budget (the better buy per byte where decode time is not the bound:
        # docs/results/long-answers.md). The digests do not depend on the budget and a slot's
        # bytes on neither: grow the budget a block at a time while its pool fits beside them.
        held2 = resolve(l1_tokens, digest_tokens=2).digest_held
        blocks = lay.device_blocks
        while (blocks < max_seq_len // bt
               and pool_slots(blocks + 1, concurrency, layers) * lay.slot_bytes + held2 <= l1_kv + held):
            blocks += 1
        pairs = resolve(blocks * bt, digest_tokens=2)
        kv2 = pairs.l1_kv
        plan["pairs_same_l1"] = {
            "digest_tokens": 2, "device_tokens": blocks * bt, "share": round(blocks * bt / max_seq_len, 4),
            "l1_bytes": kv2 + held2, "l1_kv_bytes": kv2, "l1_digest_bytes": held2,
            "config": {"preset": "long-context", **{k: v for k, v in pairs.fields.items()
                                                     if k not in ("attention", "policy")}},
        }
    return plan


def _config(layers, kv_heads, head_dim, dtype, block_tokens, device_tokens, concurrency, l2_tokens, l3, codec,
            group_size, disk_path, key_codec=None, value_codec=None) -> tuple[dict, tuple[int, int]]:
    """KVTierConfig fields for the plan, and the (L2, L3) bytes of one block record. L2 holds
    ``l2_tokens`` as ring records (headers included) and at least one block; L3 holds ``l3``
    bytes in whole segments, at least two (compaction needs a second one), each segment at
    least one record."""
    from kvtier.config import KVTierConfig
    from kvtier.store.sizing import block_record_bytes

    roles = {k: v for k, v in (("key_codec", key_codec), ("value_codec", value_codec)) if v is not None}
    probe = KVTierConfig(block_tokens=block_tokens, device_tokens=device_tokens, codec=codec, group_size=group_size,
                         **roles)
    rec_l2, rec_l3 = block_record_bytes(probe, layers, kv_heads, head_dim, _torch_dtype(dtype))
    host = max(4096, rec_l2, -(-l2_tokens // block_tokens) * layers * rec_l2)
    seg = max(rec_l3, -(-min(64 << 20, max(4096, l3 // 2)) // 4096) * 4096)  # whole pages, <= 64 MiB
    disk = max(2 * seg, -(-l3 // seg) * seg)
    return {"block_tokens": block_tokens, "device_tokens": device_tokens, "max_sequences": concurrency,
            "host_bytes": host, "disk_path": disk_path, "disk_bytes": disk, "disk_segment_bytes": seg,
            "codec": codec, **roles, "group_size": group_size}, (rec_l2, rec_l3)


def _torch_dtype(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[_CANONICAL[name]]
