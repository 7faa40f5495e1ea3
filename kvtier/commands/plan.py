"""`kvtier plan`: the options, the model shape read from them (flags or a transformers
config.json) and the printed plan; the arithmetic is :func:`kvtier.plan.make_plan`'s."""
from __future__ import annotations

import argparse
import json
import os
import sys

from kvtier.commands.cliargs import size as _size, token_count
from kvtier.plan import DTYPES, make_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvtier plan`` options to ``parser``."""
    from kvtier.config import CODECS, GROUP_SIZES
    from kvtier.configcheck import CHOICES

    m = parser.add_argument_group("model shape (a transformers config, or explicit numbers)")
    m.add_argument("--config", help="transformers config.json, or a directory holding one")
    m.add_argument("--layers", type=int, help="number of layers")
    m.add_argument("--kv-heads", type=int, help="key/value heads per layer")
    m.add_argument("--head-dim", type=int, help="dimension of one head")
    m.add_argument("--heads", type=int, help="query heads (with --kv-heads: states the GQA saving)")
    m.add_argument("--hidden-size", type=int, help="model width; head_dim = hidden_size / heads")
    m.add_argument("--dtype", choices=DTYPES, metavar="{" + ",".join(DTYPES) + "}",
                   help="KV dtype (default: the config's, else float16)")
    w = parser.add_argument_group("workload")
    w.add_argument("--concurrency", type=int, default=1, help="sequences served at once")
    w.add_argument("--avg-seq-len", type=token_count, required=False, default=None,
                   help="average tokens per sequence (e.g. 8192 or 32k)")
    w.add_argument("--max-seq-len", type=token_count, required=False, default=None,
                   help="longest sequence, in tokens (e.g. 128k)")
    c = parser.add_argument_group("storage")
    c.add_argument("--codec", default="int4", choices=CODECS, help="codec of L2/L3 (default int4)")
    for role in ("key", "value"):
        names = CHOICES[f"{role}_codec"]
        c.add_argument(f"--{role}-codec", default=None, choices=names, metavar="{" + ",".join(names) + "}",
                       help=f"codec of the {role}s where a tier stores --codec (default: --codec), "
                            f"e.g. --key-codec int4 --value-codec int2")
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
            "dtype": dtype if dtype in DTYPES else None}


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
                         6.0 if args.ratio is None else args.ratio, args.hbm_bytes, heads=shape["heads"],
                         key_codec=args.key_codec, value_codec=args.value_codec)
    except ValueError as e:
        print(f"kvtier plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=2))
        return 0
    m, w, b, s, t = plan["model"], plan["workload"], plan["bytes_per_token"], plan["bytes_per_sequence"], plan["tiers"]
    key, value = plan["roles"]["key"], plan["roles"]["value"]
    # what "codec" stands for below: one name, or the two roles' (K4V2: int4 keys, int2 values)
    codec = plan["codec"] if key["codec"] == value["codec"] else f"K {key['codec']} / V {value['codec']}"
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
          f"{_fmt(b['codec'])} as {codec} ({b['codec_ratio']:.2f}x smaller)")
    if key["codec"] != value["codec"]:
        print(f"roles      keys {key['codec']} {_fmt(key['bytes_per_block'])}, values {value['codec']} "
              f"{_fmt(value['bytes_per_block'])} per block of {plan['config']['block_tokens']} tokens (all layers)")
    table = plan["sizing_table"]
    print("KV at      " + ",  ".join(f"{int(n) // 1024}k: {_gib(v['sequence'])}" for n, v in table.items())
          + "  per sequence, full precision")
    print(f"  x {w['concurrency']:<6} " + ",  ".join(f"{int(n) // 1024}k: {_gib(v['all_sequences'])}"
                                                  for n, v in table.items()))
    print(f"KV/seq     avg {_fmt(s['avg_full'])} full / {_fmt(s['avg_codec'])} {codec};  "
          f"max {_fmt(s['max_full'])} full / {_fmt(s['max_codec'])} {codec}")
    print(f"all seqs   avg {_fmt(plan['all_sequences_full']['avg'])}, max {_fmt(plan['all_sequences_full']['max'])} "
          f"at full precision")
    flag = "" if t["ratio_in_range"] else "  (outside the 1:4-1:8 range)"
    need = plan["needed"]
    print(f"L1 HBM     {_fmt(t['l1_hbm_bytes'])}  (device_tokens={plan['config']['device_tokens']:,} per sequence, "
          f"scratch slots included)")
    print(f"L2 DRAM    {_fmt(t['l2_dram_bytes'])}  HBM:DRAM = 1:{t['dram_to_hbm']:.1f}{flag}  (host_bytes; the "
          f"working set past L1 is {_fmt(need['l2_dram_bytes'])} {codec}, at least one block record)")
    print(f"L3 SSD     {_fmt(t['l3_ssd_bytes'])}  (disk_bytes; every sequence at max length is "
          f"{_fmt(need['l3_ssd_bytes'])} {codec}, lz4 not assumed; at least two segments)")
    fields = ", ".join(f"{k}={v!r}" for k, v in plan["config"].items())
    print(f"config     KVTierConfig({fields})")
    sp = plan["sparse"]
    why = ("recommended: with dense attention each decode step reads back every block outside L1, here most "
           "of each sequence" if sp["recommended"] else "an alternative: L1 already holds a quarter or more of "
                                                           "each sequence, so dense attention reads back little")
    print(f"sparse     {why}. Sparse attention (the long-context preset) attends the sink, the recent "
          f"window and the blocks the query selects, {sp['share']:.0%} of the context per step:")
    print(f"  L1       {_fmt(sp['l1_bytes'])} = KV + digests")
    print(f"  KV       {_fmt(sp['l1_kv_bytes'])}  (device_tokens={sp['device_tokens']:,} per sequence, "
          f"scratch slots included)")
    print(f"  digests  {_fmt(sp['l1_digest_bytes'])}  ({sp['digest_share']:.0%} of L1; at max length the sealed "
          f"blocks' rows are {_fmt(sp['l1_digest_used_bytes'])}, {sp['digest_bytes_per_token']:,.0f} B/token: "
          f"{sp['digest_dtype']}, "
          + ("a key row per token" if sp["digest_tokens"] == 1 else f"a key centroid per {sp['digest_tokens']} tokens")
          + (f" and a value mean per {sp['value_digest_tokens']}" if sp["value_digest_tokens"] else "")
          + "; the rest is room the tables grew to "
          f"by a quarter at a time)")
    sfields = ", ".join(f"{k}={v!r}" for k, v in sp["config"].items() if k != "preset")
    print(f"  config   KVTierConfig.preset({sp['config']['preset']!r}, {sfields})")
    alt = sp.get("pairs_same_l1")
    if alt:
        print(f"  or       the same L1 bytes with digest_tokens=2 (a key mean per pair of tokens) and "
              f"device_tokens={alt['device_tokens']:,} ({alt['share']:.1%} of the longest sequence): the key rows "
              f"it does not keep hold KV instead: where measured (int8 rows, 8k), closer to full attention's "
              f"next-token distributions and no better in answers, each step reading more blocks back "
              f"(docs/results/long-answers.md)")
    return 0


def _gib(n: int) -> str:
    """Bytes in GiB (the unit of the sizing table), with TiB beyond 1024 GiB."""
    g = n / (1 << 30)
    return f"{g:,.1f} GiB" + (f" ({g / 1024:.2f} TiB)" if g >= 1024 else "")
