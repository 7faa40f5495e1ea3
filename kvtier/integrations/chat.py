"""`kvtier generate`: chat with a model through a kvtier cache, then print the cache's stats."""
from __future__ import annotations

import argparse
import json
import sys

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", default=None,
                   help="a user turn (repeatable); without it, turns are read from standard input, one per line")
    p.add_argument("--model", default=None, help="local transformers directory or .gguf (default: embedded SmolLM2)")
    p.add_argument("--config", default=None, help="KVTierConfig TOML file (flags below override its fields)")
    p.add_argument("--codec", default=None)
    p.add_argument("--order", default=None)
    p.add_argument("--policy", default=None)
    p.add_argument("--attention", default=None)
    p.add_argument("--hot-tokens", type=int, default=None)
    p.add_argument("--budget-tokens", type=int, default=None)
    p.add_argument("--block-tokens", type=int, default=None)
    p.add_argument("--host-bytes", type=int, default=None)
    p.add_argument("--disk-path", default="kvtier-cache", help="L3 directory ('' for no L3)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--sample", action="store_true", help="sample (temperature 0.7, top-p 0.9) instead of greedy")
    p.add_argument("--stats-json", action="store_true", help="print the stats as JSON instead of a summary")


def _config(args):
    from kvtier.config import KVTierConfig

    fields = KVTierConfig.from_toml(args.config).to_dict() if args.config else {}
    for name in ("codec", "order", "policy", "attention", "hot_tokens", "budget_tokens", "block_tokens",
                 "host_bytes"):
        v = getattr(args, name)
        if v is not None:
            fields[name] = v
    fields["disk_path"] = args.disk_path or None
    return KVTierConfig(**fields)


def _turns(args):
    if args.prompt:
        yield from args.prompt
        return
    for line in sys.stdin:
        if line.strip():
            yield line.strip()


def run(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    import kvtier
    from kvtier.integrations.model import load_model

    cfg = _config(args)
    model, tok = load_model(path=args.model) if args.model else load_model()
    cache = kvtier.attach(model, cfg)
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
            _print_summary(st)
    finally:
        cache.close()
    return 0


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def _print_summary(st: dict) -> None:
    print("\n-- kvtier cache --")
    for tier, t in st.get("tiers", {}).items():
        print(f"{tier}: {t.get('blocks', 0)} blocks, {t.get('bytes', 0):,} bytes, "
              f"hits {t.get('hits', 0)}, misses {t.get('misses', 0)}")
    for k in ("tokens", "bytes_swapped_out", "bytes_swapped_in"):
        if k in st:
            print(f"{k}: {st[k]:,}")
