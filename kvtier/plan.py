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
``ratio`` defaults to 6 (the middle of 1:4-1:8). With ``--hbm-bytes`` the L1 size is given and the
ratio follows from it; a ratio outside 4-8 is reported as such.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp16": 2, "bf16": 2, "fp32": 4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvtier plan`` options to ``parser``."""
    m = parser.add_argument_group("model shape (a transformers config, or explicit numbers)")
    m.add_argument("--config", help="transformers config.json, or a directory holding one")
    m.add_argument("--layers", type=int, help="number of layers")
    m.add_argument("--kv-heads", type=int, help="key/value heads per layer")
    m.add_argument("--head-dim", type=int, help="dimension of one head")
    m.add_argument("--dtype", choices=sorted(_DTYPE_BYTES), help="KV dtype (default: the config's, else float16)")
    w = parser.add_argument_group("workload")
    w.add_argument("--concurrency", type=int, default=1, help="sequences served at once")
    w.add_argument("--avg-seq-len", type=int, required=False, default=None, help="average tokens per sequence")
    w.add_argument("--max-seq-len", type=int, required=False, default=None, help="longest sequence, in tokens")
    c = parser.add_argument_group("storage")
    c.add_argument("--codec", default="int4", help="codec of L2/L3 (fp16, bf16, int8, int4, int2, nf4, fp4, dyn8)")
    c.add_argument("--group-size", type=int, default=32, help="quantization group size")
    c.add_argument("--block-tokens", type=int, default=64, help="tokens per block")
    c.add_argument("--ratio", type=float, default=6.0, help="DRAM:HBM capacity ratio to aim for (4-8)")
    c.add_argument("--hbm-bytes", type=_size, default=None,
                   help="HBM available for KV (e.g. 40G); the ratio then follows from it")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size like 40G or 512M, got {text!r}") from None


def _read_config(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    layers = cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg.get("num_layers")
    heads = cfg.get("num_attention_heads") or cfg.get("n_head")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and cfg.get("hidden_size") else None)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    if not (layers and kv_heads and head_dim):
        raise ValueError(f"config {path!r} lacks num_hidden_layers / num_key_value_heads / head_dim")
    return {"layers": int(layers), "kv_heads": int(kv_heads), "head_dim": int(head_dim),
            "dtype": dtype if dtype in _DTYPE_BYTES else None}


def codec_bytes_per_token(codec: str, kv_heads: int, head_dim: int, block_tokens: int, group_size: int,
                          layers: int) -> float:
    """Measured encoded bytes per token (all layers, K and V) of ``codec``."""
    import torch

    from kvtier.compress import get_codec

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(kv_heads, block_tokens, head_dim, generator=gen).to(torch.float16)
    k = get_codec(codec, group_size=group_size, axis="channel").encode(x).nbytes
    v = get_codec(codec, group_size=group_size, axis="token").encode(x).nbytes
    return (k + v) * layers / block_tokens


def make_plan(layers: int, kv_heads: int, head_dim: int, dtype: str, concurrency: int, avg_seq_len: int,
              max_seq_len: int, codec: str, group_size: int = 32, block_tokens: int = 64,
              ratio: float = 6.0, hbm_bytes: int | None = None) -> dict:
    """The plan as a dict (see the module docstring for the arithmetic)."""
    from kvtier.config import CODECS

    for name, v in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                    ("concurrency", concurrency), ("avg_seq_len", avg_seq_len), ("max_seq_len", max_seq_len),
                    ("group_size", group_size), ("block_tokens", block_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1; got {v!r}")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}; got {dtype!r}")
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {', '.join(CODECS)}; got {codec!r}")
    if avg_seq_len > max_seq_len:
        raise ValueError(f"avg_seq_len must be <= max_seq_len ({max_seq_len}); got {avg_seq_len}")
    if not 1.0 <= ratio <= 64.0:
        raise ValueError(f"ratio must be in [1, 64] (4-8 recommended); got {ratio}")

    bf = 2 * layers * kv_heads * head_dim * _DTYPE_BYTES[dtype]  # bytes per token, full precision
    bc = codec_bytes_per_token(codec, kv_heads, head_dim, block_tokens, group_size, layers)
    live = concurrency * avg_seq_len
    if hbm_bytes is None:
        hot = live * bc / (ratio * bf + bc)
    else:
        if hbm_bytes < concurrency * block_tokens * bf:
            raise ValueError(f"hbm_bytes must hold one block per sequence (>= {concurrency * block_tokens * bf} "
                             f"bytes here); got {hbm_bytes}")
        hot = min(live, hbm_bytes / bf)
    hot_tokens = max(block_tokens, int(hot / concurrency) // block_tokens * block_tokens)
    l1 = hot_tokens * concurrency * bf
    l2 = max(0.0, (live - hot_tokens * concurrency) * bc)
    l3 = concurrency * max_seq_len * bc
    achieved = l2 / l1 if l1 else math.inf
    return {
        "model": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype},
        "workload": {"concurrency": concurrency, "avg_seq_len": avg_seq_len, "max_seq_len": max_seq_len},
        "codec": codec,
        "bytes_per_token": {"full": bf, "codec": bc, "codec_ratio": bf / bc},
        "bytes_per_sequence": {"avg_full": bf * avg_seq_len, "max_full": bf * max_seq_len,
                               "avg_codec": bc * avg_seq_len, "max_codec": bc * max_seq_len},
        "all_sequences_full": {"avg": bf * live, "max": bf * concurrency * max_seq_len},
        "tiers": {"l1_hbm_bytes": int(l1), "l2_dram_bytes": int(math.ceil(l2)), "l3_ssd_bytes": int(math.ceil(l3)),
                  "dram_to_hbm": achieved, "ratio_in_range": 4.0 <= achieved <= 8.0},
        "config": {"block_tokens": block_tokens, "hot_tokens": hot_tokens, "max_sequences": concurrency,
                   "host_bytes": int(math.ceil(l2)), "disk_bytes": int(math.ceil(l3)), "codec": codec,
                   "group_size": group_size},
    }


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return str(n)


def run(args: argparse.Namespace) -> int:
    """Print the plan; 0 on success, 2 on bad input (message on stderr)."""
    try:
        shape = {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype}
        if args.config:
            got = _read_config(args.config)
            for k, v in got.items():
                if shape[k] is None:
                    shape[k] = v
        missing = [k for k in ("layers", "kv_heads", "head_dim") if shape[k] is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} needed: pass --config or --layers/--kv-heads/--head-dim")
        if args.avg_seq_len is None and args.max_seq_len is None:
            raise ValueError("avg_seq_len or max_seq_len needed (--avg-seq-len, --max-seq-len)")
        avg = args.avg_seq_len if args.avg_seq_len is not None else args.max_seq_len
        mx = args.max_seq_len if args.max_seq_len is not None else avg
        plan = make_plan(shape["layers"], shape["kv_heads"], shape["head_dim"], shape["dtype"] or "float16",
                         args.concurrency, avg, mx, args.codec, args.group_size, args.block_tokens,
                         args.ratio, args.hbm_bytes)
    except (ValueError, OSError) as e:
        print(f"kvtier plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=2))
        return 0
    m, w, b, s, t = plan["model"], plan["workload"], plan["bytes_per_token"], plan["bytes_per_sequence"], plan["tiers"]
    print(f"model      {m['layers']} layers x {m['kv_heads']} kv heads x head_dim {m['head_dim']}, {m['dtype']}")
    print(f"workload   {w['concurrency']} sequences, avg {w['avg_seq_len']} / max {w['max_seq_len']} tokens")
    print(f"KV/token   {_fmt(b['full'])} full (2 x layers x kv_heads x head_dim x bytes), "
          f"{_fmt(b['codec'])} as {plan['codec']} ({b['codec_ratio']:.2f}x smaller)")
    print(f"KV/seq     avg {_fmt(s['avg_full'])} full / {_fmt(s['avg_codec'])} {plan['codec']};  "
          f"max {_fmt(s['max_full'])} full / {_fmt(s['max_codec'])} {plan['codec']}")
    print(f"all seqs   avg {_fmt(plan['all_sequences_full']['avg'])}, max {_fmt(plan['all_sequences_full']['max'])} "
          f"at full precision")
    flag = "" if t["ratio_in_range"] else "  (outside the 1:4-1:8 range)"
    print(f"L1 HBM     {_fmt(t['l1_hbm_bytes'])}  (hot_tokens={plan['config']['hot_tokens']} per sequence)")
    print(f"L2 DRAM    {_fmt(t['l2_dram_bytes'])}  HBM:DRAM = 1:{t['dram_to_hbm']:.1f}{flag}")
    print(f"L3 SSD     {_fmt(t['l3_ssd_bytes'])}  (every sequence at max length, {plan['codec']}, lz4 not assumed)")
    cfg = plan["config"]
    print(f"config     KVTierConfig(block_tokens={cfg['block_tokens']}, hot_tokens={cfg['hot_tokens']}, "
          f"max_sequences={cfg['max_sequences']}, host_bytes={cfg['host_bytes']}, disk_bytes={cfg['disk_bytes']}, "
          f"codec={cfg['codec']!r}, group_size={cfg['group_size']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier plan", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
