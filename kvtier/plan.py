"""``kvtier plan``: KV size per token and per sequence, and recommended tier sizes.

Size of full-precision KV (the seed's formula):

    bytes = 2 (K and V) x layers x kv_heads x head_dim x bytes_per_element x tokens

The codec's size per token is measured, not assumed: one block is encoded with the real codec
(scales and zeros included) and its ``nbytes`` divided by the block's tokens.

Sizing (per the seed's practice: HBM:DRAM about 1:4 to 1:8, SSD as backstop):

```
 T  = concurrency x avg_seq_len              tokens live on average
 L1 = h tokens at full precision              h: the hot share
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

The seed's table (KV per sequence at 4k / 32k / 128k tokens, and for ``--concurrency`` of them)
is printed for the model: LLaMA-2-70B as the seed counts it (80 layers, hidden 8192, fp16, one KV
head per query head: ``--layers 80 --hidden-size 8192 --heads 64``) gives 10 / 80 / 320 GiB per
sequence and 3,200 GiB for 10 x 128k; with its real 8 KV heads (GQA, ``--kv-heads 8``) each
figure is 8x smaller.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from fractions import Fraction

from kvtier.cliargs import size as _size, token_count

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp16": 2, "bf16": 2, "fp32": 4}
_CANONICAL = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "fp16": "float16",
              "bf16": "bfloat16", "fp32": "float32"}
# the sequence lengths of the seed's sizing table (4k, 32k, 128k)
_SEED_LENGTHS = (4096, 32768, 131072)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvtier plan`` options to ``parser``."""
    from kvtier.config import CODECS, GROUP_SIZES

    m = parser.add_argument_group("model shape (a transformers config, or explicit numbers)")
    m.add_argument("--config", help="transformers config.json, or a directory holding one")
    m.add_argument("--layers", type=int, help="number of layers")
    m.add_argument("--kv-heads", type=int, help="key/value heads per layer")
    m.add_argument("--head-dim", type=int, help="dimension of one head")
    m.add_argument("--heads", type=int, help="query heads (with --kv-heads: states the GQA saving)")
    m.add_argument("--hidden-size", type=int, help="model width; head_dim = hidden_size / heads")
    m.add_argument("--dtype", choices=sorted(_DTYPE_BYTES), metavar="{" + ",".join(sorted(_DTYPE_BYTES)) + "}",
                   help="KV dtype (default: the config's, else float16)")
    w = parser.add_argument_group("workload")
    w.add_argument("--concurrency", type=int, default=1, help="sequences served at once")
    w.add_argument("--avg-seq-len", type=token_count, required=False, default=None,
                   help="average tokens per sequence (e.g. 8192 or 32k)")
    w.add_argument("--max-seq-len", type=token_count, required=False, default=None,
                   help="longest sequence, in tokens (e.g. 128k)")
    c = parser.add_argument_group("storage")
    c.add_argument("--codec", default="int4", choices=CODECS, help="codec of L2/L3 (default int4)")
    c.add_argument("--group-size", type=int, default=32, choices=GROUP_SIZES, help="quantization group size")
    c.add_argument("--block-tokens", type=int, default=64, help="tokens per block")
    c.add_argument("--ratio", type=float, default=None,
                   help="DRAM:HBM capacity ratio to aim for (default 6; 4-8 recommended); not with --hbm-bytes")
    c.add_argument("--hbm-bytes", type=_size, default=None,
                   help="HBM available for KV (e.g. 40G); the ratio then follows from it")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _read_config(path: str) -> dict:
    where = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(where, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"--config {path!r}: no such file (a transformers config.json, or a directory "
                         f"holding one)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {where!r} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {where!r} is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--config {where!r} must hold a JSON object (a transformers config); it holds "
                         f"a {type(cfg).__name__}")
    text = cfg.get("text_config")
    cfg = text if isinstance(text, dict) else cfg  # multimodal configs nest the language model's

    def count(*names):
        for n in names:
            v = cfg.get(n)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return None

    layers = count("num_hidden_layers", "n_layer", "num_layers")
    heads = count("num_attention_heads", "n_head")
    kv_heads = count("num_key_value_heads") or heads
    hidden = count("hidden_size", "n_embd")
    head_dim = count("head_dim") or (hidden // heads if heads and hidden and hidden % heads == 0 else None)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    if not (layers and kv_heads and head_dim):
        raise ValueError(f"--config {where!r} lacks num_hidden_layers / num_key_value_heads / head_dim "
                         f"(or hidden_size and num_attention_heads) as positive integers")
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "heads": heads,
            "dtype": dtype if dtype in _DTYPE_BYTES else None}


def codec_bytes_per_block(codec: str, dtype: str, kv_heads: int, head_dim: int, block_tokens: int,
                          group_size: int) -> int:
    """Measured encoded bytes of one block of one layer, K and V (scales and zeros included)."""
    import torch

    from kvtier.compress import get_codec

    tdtype = _torch_dtype(dtype)
    if codec in ("fp16", "bf16") and tdtype != torch.float32:
        codec = "bf16" if tdtype == torch.bfloat16 else "fp16"  # a 16-bit codec follows the KV dtype
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(kv_heads, block_tokens, head_dim, generator=gen).to(tdtype)  # [kv_heads, bt, head_dim]
    from kvtier.config import KVTierConfig

    cfg = KVTierConfig(group_size=group_size)  # the codecs a planned config's store uses
    k = get_codec(codec, **cfg.codec_kwargs(codec, "key")).encode(x).nbytes
    v = get_codec(codec, **cfg.codec_kwargs(codec, "value")).encode(x).nbytes
    return k + v


def codec_bytes_per_token(codec: str, kv_heads: int, head_dim: int, block_tokens: int, group_size: int,
                          layers: int, dtype: str = "float16") -> float:
    """Measured encoded bytes per token (all layers, K and V) of ``codec``."""
    return codec_bytes_per_block(codec, dtype, kv_heads, head_dim, block_tokens, group_size) * layers / block_tokens


def _ceil(x: Fraction) -> int:
    return -(-x.numerator // x.denominator)


def make_plan(layers: int, kv_heads: int, head_dim: int, dtype: str, concurrency: int, avg_seq_len: int,
              max_seq_len: int, codec: str, group_size: int = 32, block_tokens: int = 64,
              ratio: float = 6.0, hbm_bytes: int | None = None, heads: int | None = None,
              disk_path: str = "kvtier-cache") -> dict:
    """The plan as a dict (see the module docstring for the arithmetic). Byte counts are exact
    integers; the ``config`` entry is checked by ``KVTierConfig`` (and its sizes against this
    model's shape) before it is returned.

    Args:
        heads: query heads, when known: ``kv_heads < heads`` is grouped-query attention and the
            plan states how much smaller the KV is than with one KV head per query head.
    """
    from kvtier.config import CODECS, GROUP_SIZES, KVTierConfig
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
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}; got {group_size!r}")
    if avg_seq_len > max_seq_len:
        raise ValueError(f"avg_seq_len must be <= max_seq_len ({max_seq_len}); got {avg_seq_len}")
    if not 1.0 <= ratio <= 64.0:
        raise ValueError(f"ratio must be in [1, 64] (4-8 recommended); got {ratio}")
    dtype = _CANONICAL[dtype]
    bf = 2 * layers * kv_heads * head_dim * _DTYPE_BYTES[dtype]  # bytes per token, full precision
    per_block = codec_bytes_per_block(codec, dtype, kv_heads, head_dim, block_tokens, group_size) * layers
    bc = Fraction(per_block, block_tokens)  # encoded bytes per token, exact
    live = concurrency * avg_seq_len
    if hbm_bytes is None:
        hot = live * bc / (Fraction(ratio) * bf + bc)
    else:
        if hbm_bytes < concurrency * block_tokens * bf:
            raise ValueError(f"hbm_bytes must hold one block per sequence (>= {concurrency * block_tokens * bf:,} "
                             f"bytes here); got {hbm_bytes:,}")
        hot = Fraction(min(live, hbm_bytes // bf))
    # per sequence, whole blocks, at least one and at most what the longest sequence needs
    device_tokens = int(hot / concurrency) // block_tokens * block_tokens
    device_tokens = max(block_tokens, min(device_tokens, _ceil(Fraction(max_seq_len, block_tokens)) * block_tokens))
    need_l2 = _ceil(max(Fraction(0), (live - device_tokens * concurrency) * bc))
    need_l3 = _ceil(concurrency * max_seq_len * bc)
    try:
        cfg = _config(layers, kv_heads, head_dim, dtype, block_tokens, device_tokens, concurrency,
                      max(0, live - device_tokens * concurrency), need_l3, codec, group_size, disk_path)
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
        "bytes_per_token": {"full": bf, "codec": round(float(bc), 3), "codec_per_block": per_block,
                            "codec_ratio": round(float(bf / bc), 3)},
        "bytes_per_sequence": {"avg_full": bf * avg_seq_len, "max_full": bf * max_seq_len,
                               "avg_codec": _ceil(bc * avg_seq_len), "max_codec": _ceil(bc * max_seq_len)},
        "all_sequences_full": {"avg": bf * live, "max": bf * concurrency * max_seq_len},
        "seed_table": {str(n): {"sequence": bf * n, "all_sequences": bf * n * concurrency}
                       for n in _SEED_LENGTHS},
        "tiers": {"l1_hbm_bytes": l1, "l2_dram_bytes": l2, "l3_ssd_bytes": l3,
                  "dram_to_hbm": round(float(achieved), 3), "ratio_in_range": 4 <= achieved <= 8},
        # the encoded KV the workload puts past L1 (L2: the average working set; L3: every
        # sequence at its longest): the tiers above are these rounded up to what a store allocates
        "needed": {"l2_dram_bytes": need_l2, "l3_ssd_bytes": need_l3},
        "config": cfg,
    }
    out["sparse"] = _sparse_plan(layers, kv_heads, head_dim, dtype, concurrency, max_seq_len, device_tokens,
                                 block_tokens, cfg, bf)
    if heads is not None:
        out["gqa"] = {"heads": heads, "kv_heads": kv_heads, "mha_bytes_per_token": bf * heads // kv_heads,
                      "reduction": heads // kv_heads}
    return out


#: L1 share of the context of the sparse alternative: the share the demo (RULER NIAH at 8k) and
#: the NIAH family at 32k measured (docs/results/2026-12-01-ruler-niah.md)
SPARSE_SHARE = Fraction(3, 100)


def _sparse_plan(layers, kv_heads, head_dim, dtype, concurrency, max_seq_len, dense_hot, dense_block, dense_cfg,
                 bf) -> dict:
    """The long-context preset for this workload: L1 = 3% of the longest sequence (whole 16-token
    blocks, at least four), its L1 bytes with the key digests of every sealed block (an int8
    centroid per ``digest_tokens`` tokens and a float32 scale: ``head_dim + 4`` bytes per kv head
    and layer), and whether dense attention would read most of each sequence back every step
    (L1 under a quarter of the longest sequence)."""
    from kvtier.config import KVTierConfig, lossless_codec
    from kvtier.presets import preset_fields
    from kvtier.store.layout import pool_slots
    from kvtier.store.sizing import check_model

    probe = KVTierConfig.preset("long-context")
    bt = probe.block_tokens
    hot = max(4 * bt, int(max_seq_len * SPARSE_SHARE) // bt * bt)
    fields = preset_fields("long-context", {
        "device_tokens": hot, "max_sequences": concurrency, "host_bytes": dense_cfg["host_bytes"],
        "disk_path": dense_cfg["disk_path"], "disk_bytes": dense_cfg["disk_bytes"],
        "disk_segment_bytes": dense_cfg["disk_segment_bytes"], "codec": dense_cfg["codec"],
        "group_size": dense_cfg["group_size"]}, lossless_codec)
    cfg = KVTierConfig(**fields)
    check_model(cfg, layers, kv_heads, head_dim, _torch_dtype(dtype), machine=False)
    digest_tokens = cfg.digest_tokens
    digest_per_token = Fraction(layers * kv_heads * (head_dim + 4), digest_tokens)
    l1_kv = pool_slots(hot // bt, concurrency, layers) * (bf // layers) * bt
    l1_digests = _ceil(digest_per_token * max_seq_len * concurrency)
    return {
        "recommended": dense_hot * 4 < max_seq_len,
        "share": float(SPARSE_SHARE),
        "device_tokens": hot,
        "l1_kv_bytes": l1_kv,
        "l1_digest_bytes": l1_digests,
        "digest_bytes_per_token": round(float(digest_per_token), 3),
        "config": {"preset": "long-context", **{k: v for k, v in fields.items()
                                                 if k not in ("attention", "policy")}},
    }


def _config(layers, kv_heads, head_dim, dtype, block_tokens, device_tokens, concurrency, l2_tokens, l3, codec,
            group_size, disk_path) -> dict:
    """KVTierConfig fields for the plan. L2 holds ``l2_tokens`` as ring records (headers
    included) and at least one block; L3 holds ``l3`` bytes in whole segments, at least two
    (compaction needs a second one), each segment at least one record."""
    from kvtier.config import KVTierConfig
    from kvtier.store.sizing import block_record_bytes

    probe = KVTierConfig(block_tokens=block_tokens, device_tokens=device_tokens, codec=codec, group_size=group_size)
    rec_l2, rec_l3 = block_record_bytes(probe, layers, kv_heads, head_dim, _torch_dtype(dtype))
    host = max(4096, rec_l2, -(-l2_tokens // block_tokens) * layers * rec_l2)
    seg = max(rec_l3, -(-min(64 << 20, max(4096, l3 // 2)) // 4096) * 4096)  # whole pages, <= 64 MiB
    disk = max(2 * seg, -(-l3 // seg) * seg)
    return {"block_tokens": block_tokens, "device_tokens": device_tokens, "max_sequences": concurrency,
            "host_bytes": host, "disk_path": disk_path, "disk_bytes": disk, "disk_segment_bytes": seg,
            "codec": codec, "group_size": group_size}


def _torch_dtype(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[_CANONICAL[name]]


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return str(n)


def _shape(args: argparse.Namespace) -> dict:
    """The model shape from the flags, completed from --config where a flag is not given."""
    shape = {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "heads": args.heads,
             "dtype": args.dtype}
    if args.config:
        for k, v in _read_config(args.config).items():
            if shape[k] is None:
                shape[k] = v
    if shape["head_dim"] is None and args.hidden_size is not None:
        if not shape["heads"] or args.hidden_size % shape["heads"]:
            raise ValueError(f"--hidden-size {args.hidden_size} needs --heads, a divisor of it "
                             f"(head_dim = hidden_size / heads)")
        shape["head_dim"] = args.hidden_size // shape["heads"]
    if shape["kv_heads"] is None and shape["heads"] is not None:
        shape["kv_heads"] = shape["heads"]  # no --kv-heads: one KV head per query head (MHA)
    missing = [k for k in ("layers", "kv_heads", "head_dim") if shape[k] is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} needed: pass --config or --layers/--kv-heads/--head-dim "
                         f"(or --hidden-size with --heads)")
    return shape


def run(args: argparse.Namespace) -> int:
    """Print the plan; 0 on success, 2 on bad input (message on stderr)."""
    try:
        if args.ratio is not None and args.hbm_bytes is not None:
            raise ValueError("--ratio and --hbm-bytes exclude each other: with --hbm-bytes the L1 size is given and "
                             "the DRAM:HBM ratio follows from it; pass one of them")
        shape = _shape(args)
        if args.avg_seq_len is None and args.max_seq_len is None:
            raise ValueError("avg_seq_len or max_seq_len needed (--avg-seq-len, --max-seq-len)")
        avg = args.avg_seq_len if args.avg_seq_len is not None else args.max_seq_len
        mx = args.max_seq_len if args.max_seq_len is not None else avg
        plan = make_plan(shape["layers"], shape["kv_heads"], shape["head_dim"], shape["dtype"] or "float16",
                         args.concurrency, avg, mx, args.codec, args.group_size, args.block_tokens,
                         6.0 if args.ratio is None else args.ratio, args.hbm_bytes, heads=shape["heads"])
    except ValueError as e:
        print(f"kvtier plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=2))
        return 0
    m, w, b, s, t = plan["model"], plan["workload"], plan["bytes_per_token"], plan["bytes_per_sequence"], plan["tiers"]
    print(f"model      {m['layers']} layers x {m['kv_heads']} kv heads x head_dim {m['head_dim']}, {m['dtype']}")
    if "gqa" in plan:
        g = plan["gqa"]
        if g["reduction"] > 1:
            print(f"GQA        {g['kv_heads']} kv heads for {g['heads']} query heads: KV is 1/{g['reduction']} of "
                  f"one KV head per query head (MHA: {_fmt(g['mha_bytes_per_token'])} per token)")
        else:
            print("MHA        one KV head per query head; a GQA model with fewer kv heads (--kv-heads) "
                  "needs heads/kv_heads times less")
    print(f"workload   {w['concurrency']} sequences, avg {w['avg_seq_len']:,} / max {w['max_seq_len']:,} tokens")
    print(f"KV/token   {_fmt(b['full'])} full (2 x layers x kv_heads x head_dim x bytes), "
          f"{_fmt(b['codec'])} as {plan['codec']} ({b['codec_ratio']:.2f}x smaller)")
    seed = plan["seed_table"]
    print("KV at      " + ",  ".join(f"{int(n) // 1024}k: {_gib(v['sequence'])}" for n, v in seed.items())
          + "  per sequence, full precision")
    print(f"  x {w['concurrency']:<6} " + ",  ".join(f"{int(n) // 1024}k: {_gib(v['all_sequences'])}"
                                                  for n, v in seed.items()))
    print(f"KV/seq     avg {_fmt(s['avg_full'])} full / {_fmt(s['avg_codec'])} {plan['codec']};  "
          f"max {_fmt(s['max_full'])} full / {_fmt(s['max_codec'])} {plan['codec']}")
    print(f"all seqs   avg {_fmt(plan['all_sequences_full']['avg'])}, max {_fmt(plan['all_sequences_full']['max'])} "
          f"at full precision")
    flag = "" if t["ratio_in_range"] else "  (outside the 1:4-1:8 range)"
    need = plan["needed"]
    print(f"L1 HBM     {_fmt(t['l1_hbm_bytes'])}  (device_tokens={plan['config']['device_tokens']:,} per sequence, "
          f"scratch slots included)")
    print(f"L2 DRAM    {_fmt(t['l2_dram_bytes'])}  HBM:DRAM = 1:{t['dram_to_hbm']:.1f}{flag}  (host_bytes; the "
          f"working set past L1 is {_fmt(need['l2_dram_bytes'])} {plan['codec']}, at least one block record)")
    print(f"L3 SSD     {_fmt(t['l3_ssd_bytes'])}  (disk_bytes; every sequence at max length is "
          f"{_fmt(need['l3_ssd_bytes'])} {plan['codec']}, lz4 not assumed; at least two segments)")
    fields = ", ".join(f"{k}={v!r}" for k, v in plan["config"].items())
    print(f"config     KVTierConfig({fields})")
    sp = plan["sparse"]
    why = ("recommended: with dense attention each decode step reads back every block outside L1, here most "
           "of each sequence" if sp["recommended"] else "an alternative: L1 already holds a quarter or more of "
                                                           "each sequence, so dense attention reads back little")
    print(f"sparse     {why}. Sparse attention (the long-context preset) attends the sink, the recent "
          f"window and the blocks the query selects, {sp['share']:.0%} of the context per step:")
    print(f"  L1       {_fmt(sp['l1_kv_bytes'] + sp['l1_digest_bytes'])} = KV {_fmt(sp['l1_kv_bytes'])} "
          f"(device_tokens={sp['device_tokens']:,}) + key digests {_fmt(sp['l1_digest_bytes'])} "
          f"({sp['digest_bytes_per_token']:,.0f} B/token at max length)")
    sfields = ", ".join(f"{k}={v!r}" for k, v in sp["config"].items() if k != "preset")
    print(f"  config   KVTierConfig.preset({sp['config']['preset']!r}, {sfields})")
    return 0


def _gib(n: int) -> str:
    """Bytes in GiB (the unit of the seed's table), with TiB beyond 1024 GiB."""
    g = n / (1 << 30)
    return f"{g:,.1f} GiB" + (f" ({g / 1024:.2f} TiB)" if g >= 1024 else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier plan", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
