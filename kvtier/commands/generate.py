"""`kvtier generate`: chat with a model through a kvtier cache, then print the cache's stats.

Without ``--disk-path`` (or a ``disk_path`` in the ``--config`` file) each run gets its own L3 directory (a fresh temporary one, removed at the
end), so two runs at once never meet on one directory's lock; ``--disk-path DIR`` keeps L3 in
``DIR`` across runs (content-addressed blocks are found again by the next run), and a second run
on a directory in use stops with a sentence, exit code 2. Every input is checked before the
model loads.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.commands.cliargs import choices_of, size, token_count
    from kvtier.config import CODECS, Attention, Order, Policy
    from kvtier.hardware import DTYPE_CHOICES
    from kvtier.presets import PRESET_NAMES

    p.add_argument("--prompt", action="append", default=None,
                   help="a user turn (repeatable); without it, turns are read from standard input, one per line")
    p.add_argument("--model", default=None, help="local transformers directory or .gguf (default: embedded SmolLM2)")
    p.add_argument("--config", default=None, help="KVTierConfig TOML file (flags below override its fields)")
    p.add_argument("--preset", default=None, choices=PRESET_NAMES,
                   help="a named KVTierConfig preset (docs/configuration.md); --config and the flags below override it")
    p.add_argument("--codec", default=None, choices=CODECS, help="codec of blocks below L1 (default int4)")
    p.add_argument("--order", default=None, choices=choices_of(Order),
                   help="where blocks are quantized: on the L1->L2 move (compress-then-tier, default) or L2->L3")
    p.add_argument("--policy", default=None, choices=choices_of(Policy), help="which blocks leave L1 first (default h2o)")
    p.add_argument("--attention", default=None, choices=choices_of(Attention),
                   help="dense: attend to every token; sparse: sink + recent window + the blocks the query selects")
    p.add_argument("--device-tokens", type=token_count, default=None,
                   help="tokens per sequence and layer kept in L1 at full precision (e.g. 512 or 4k)")
    # the old name of --device-tokens, accepted for one release (the config warns naming the new one)
    p.add_argument("--hot-tokens", type=token_count, default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget-tokens", type=token_count, default=None,
                   help="sparse attention: tokens attended per step (default: device-tokens)")
    p.add_argument("--block-tokens", type=int, default=None, help="tokens per block (default 16 sparse, 64 dense)")
    p.add_argument("--host-bytes", type=size, default=None, help="L2 DRAM ring size, e.g. 256M or 2G")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="model and KV dtype; auto: bfloat16 on a CPU with native bf16 matmul, else float32")
    p.add_argument("--disk-path", default=None,
                   help="L3 directory, kept across runs (default: a per-run temporary directory; '' for no L3)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="cap on each reply's tokens (default 128)")
    p.add_argument("--sample", action="store_true", help="sample (temperature 0.7, top-p 0.9) instead of greedy")
    p.add_argument("--stats-json", action="store_true", help="print the stats as JSON instead of a summary")


def _fields(args) -> dict:
    """KVTierConfig fields: the --preset's, the --config file's over them, then the flags."""
    from kvtier.config import KVTierConfig, lossless_codec

    fields = {}
    if args.preset:
        from kvtier.presets import preset_fields

        from kvtier.hardware import parse_dtype

        # the model's dtype, so "lossless" takes the exact codec of that dtype
        dtype = str(parse_dtype(args.dtype)).removeprefix("torch.")
        fields = preset_fields(args.preset, {"dtype": dtype}, lossless_codec)
    if args.config:
        fields.update(KVTierConfig.from_toml(args.config).to_dict())
    for name in ("codec", "order", "policy", "attention", "device_tokens", "hot_tokens", "budget_tokens",
                 "block_tokens", "host_bytes"):
        v = getattr(args, name)
        if v is not None:
            fields[name] = v
    if args.disk_path is not None:
        fields["disk_path"] = args.disk_path or None
    return fields


def _config(args, scratch: str | None):
    """The run's config; ``scratch`` is the per-run L3 directory used when neither --disk-path
    nor the --config file names one."""
    from kvtier.config import KVTierConfig

    fields = _fields(args)
    if args.disk_path is None and fields.get("disk_path") is None:
        fields["disk_path"] = scratch
    return KVTierConfig(**fields)


def _turns(args):
    if args.prompt:
        yield from args.prompt
        return
    for line in sys.stdin:
        if line.strip():
            yield line.strip()


def run(args: argparse.Namespace) -> int:
    """Chat, then print the summary; ValueError (exit code 2 in the CLI) on bad input."""
    if isinstance(args.max_new_tokens, bool) or args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1; got {args.max_new_tokens}")
    scratch = tempfile.mkdtemp(prefix="kvtier-generate-")
    try:
        cfg = _config(args, scratch)  # checked before the model loads
        return _chat(args, cfg)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _attach(model, cfg):
    import kvtier
    from kvtier.tiers import DirectoryLockedError

    try:
        return kvtier.attach(model, cfg)
    except DirectoryLockedError:
        raise ValueError(f"--disk-path {cfg.disk_path!r} is in use by another kvtier process (a second "
                         f"`kvtier generate` on the same directory?): pass another --disk-path, or none "
                         f"for a per-run directory") from None


def _chat(args: argparse.Namespace, cfg) -> int:
    from transformers import TextStreamer

    from kvtier.models import load_model

    from kvtier.hardware import parse_dtype

    model, tok = load_model(path=args.model, dtype=parse_dtype(args.dtype))
    cache = _attach(model, cfg)
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    messages: list[dict] = []
    fed = torch.empty(0, dtype=torch.long)   # tokens whose KV the cache holds
    try:
        for turn in _turns(args):
            messages.append({"role": "user", "content": turn})
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)["input_ids"]
            # generate() feeds only the tokens past what the cache holds, which is right only if
            # the re-rendered conversation starts with exactly those tokens: cut the cache back to
            # the part it shares with them (the template may render the last reply differently)
            keep = _common_prefix(ids[0, :-1], fed)
            if keep < fed.numel():
                cache.crop(keep - fed.numel())
            with torch.inference_mode():
                out = model.generate(ids, cache=cache, max_new_tokens=args.max_new_tokens,
                                     do_sample=args.sample, temperature=0.7 if args.sample else None,
                                     top_p=0.9 if args.sample else None, streamer=streamer,
                                     pad_token_id=tok.eos_token_id)
            fed = out[0, :-1]  # the last sampled token was never fed back
            reply = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
        st = cache.stats()
        if args.stats_json:
            print(json.dumps(st, indent=2))
        else:
            print(summary(st, turns=sum(m["role"] == "user" for m in messages)))
    finally:
        cache.close()
    return 0


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"


def summary(st: dict, turns: int | None = None) -> str:
    """The end-of-run summary of ``TieredCache.stats()``: the conversation's tokens, then blocks
    and bytes per tier, what moved between tiers, and hits and misses."""
    integ = st.get("integration") or {}
    blocks, nbytes = st.get("blocks", {}), st.get("bytes", {})
    comp = st.get("compression", {})
    conv = integ.get("seq_length", 0)
    lines = ["", "-- kvtier cache --",
             f"conversation  {conv:,} tokens" + (f" over {turns} turn{'s' * (turns != 1)}" if turns else "")
             + f", {st.get('sequences', 0)} sequence{'s' * (st.get('sequences', 0) != 1)}"]
    names = {"l1": "L1 device", "l2": "L2 host", "l3": "L3 disk"}
    codec = {"l1": "full precision", "l2": comp.get("host_codec"), "l3": comp.get("disk_codec")}
    copies = st.get("copies", {})
    for tier, label in names.items():
        if tier == "l3" and not blocks.get("l3") and not nbytes.get("l3"):
            continue
        # blocks whose home is the tier; copies also counts write-through and kept copies
        extra = f" ({copies[tier]:,} copies)" if copies.get(tier, blocks.get(tier)) != blocks.get(tier) else ""
        lines.append(f"{label:<13} {blocks.get(tier, 0):,} blocks{extra}, {_size(nbytes.get(tier, 0))} "
                     f"({codec[tier]})")
    out, inn = st.get("swap_out_bytes", {}), st.get("swap_in_bytes", {})
    lines.append(f"swapped out   {_size(out.get('l2', 0))} to L2, {_size(out.get('l3', 0))} to L3; "
                 f"swapped in {_size(inn.get('l2', 0) + inn.get('l3', 0))} ({st.get('swap_in_blocks', 0):,} blocks)")
    hits, misses = st.get("hits", {}), st.get("misses", {})
    lines.append("hits/misses   " + ", ".join(f"{t.upper()} {hits.get(t, 0):,}/{misses.get(t, 0):,}"
                                               for t in ("l1", "l2", "l3")))
    per_token = (st.get("conversation") or {}).get("bytes_per_token_all_layers") or {}
    held = [f"{t.upper()} {v:,.0f} B" for t, v in per_token.items() if v is not None]
    if held:
        lines.append("per token     " + ", ".join(held) + " (this conversation, all layers)")
    return "\n".join(lines)
