"""`kvtier cache ...`: inspect, verify, pin, evict and clear L3 directories (``kvtier.cache_admin``)."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    # no subcommand prints this command's help (run() below) rather than argparse's terse error
    sub = p.add_subparsers(dest="cache_command", required=False)
    c = sub.add_parser("clear", help="delete an L3 directory's records and files (refused while in use)")
    c.add_argument("dirs", nargs="+", metavar="DIR", help="a disk_path kvtier used")
    c = sub.add_parser("ls", help="what is stored, by model identity and codec, with bytes and ages")
    c.add_argument("dir", metavar="DIR")
    c = sub.add_parser("stat", help="records, bytes, segments, pins and the serving pid, as JSON")
    c.add_argument("dir", metavar="DIR")
    c = sub.add_parser("verify", help="CRC-check every live record; --drop deletes the damaged ones")
    c.add_argument("dir", metavar="DIR")
    c.add_argument("--drop", action="store_true", help="delete the damaged records (refused while in use)")
    c = sub.add_parser("pin", help="keep a prefix's blocks from eviction (works while serving)")
    c.add_argument("dir", metavar="DIR")
    c.add_argument("label", help="a name for the pin (unpin takes it)")
    c.add_argument("--tokens", help="comma-separated token ids of the prefix")
    c.add_argument("--text", help="the prefix as text (needs --tokenizer)")
    c.add_argument("--tokenizer", help="a local tokenizer directory (transformers AutoTokenizer)")
    c.add_argument("--block-tokens", type=int, help="tokens per block (default: found from what is stored)")
    c.add_argument("--salt", default="", help="the tenant whose conversations stored the prefix "
                   "(the salt given to kvtier.attach; default: none)")
    c = sub.add_parser("unpin", help="drop a pin by its label")
    c.add_argument("dir", metavar="DIR")
    c.add_argument("label")
    c = sub.add_parser("evict", help="delete records of a model identity and/or older than an age (not pinned)")
    c.add_argument("dir", metavar="DIR")
    c.add_argument("--identity", help="model identity key (first key component, as ls shows it)")
    c.add_argument("--older-than", type=float, metavar="SECONDS")


def _token_ids(args) -> list[int]:
    if args.tokens is not None:
        try:
            return [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--tokens must be comma-separated integers; got {args.tokens!r}") from None
    if args.text is None:
        raise ValueError("pin needs --tokens or --text")
    if args.tokenizer is None:
        raise ValueError("--text needs --tokenizer (a local tokenizer directory)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    except OSError as e:
        raise ValueError(f"--tokenizer {args.tokenizer!r} is not a local tokenizer: {e}") from None
    return list(tok(args.text)["input_ids"])


def run(args: argparse.Namespace) -> int:
    from kvtier.cache_admin import CacheDirectory
    from kvtier.tiers import DirectoryLockedError

    if args.cache_command is None:
        args.parser.print_help()
        return 0
    try:
        return _dispatch(args, CacheDirectory)
    except DirectoryLockedError as e:
        raise ValueError(str(e)) from e
    except OSError as e:  # a read-only or immutable directory, a full disk: a sentence, not a traceback
        where = getattr(args, "dir", None) or ", ".join(getattr(args, "dirs", []))
        raise ValueError(f"{where}: cannot {args.cache_command} it ({e.strerror or e}"
                         f"{f': {e.filename}' if e.filename else ''}); is it writable by this user?") from None


def _dispatch(args: argparse.Namespace, CacheDirectory) -> int:
    cmd = args.cache_command
    if cmd == "clear":
        for d in args.dirs:
            files, freed = CacheDirectory(d).clear()
            print(f"{d}: removed {files} segment file(s), {freed:,} bytes freed")
        return 0
    cd = CacheDirectory(args.dir)
    if cmd == "ls":
        print(f"{'identity':34} {'codec':6} {'records':>8} {'bytes':>14} {'oldest s':>9} {'newest s':>9}")
        for g in cd.ls():
            print(f"{g.identity:34} {g.codec:6} {g.records:8} {g.bytes:14,} {g.oldest_s:9.0f} {g.newest_s:9.0f}")
    elif cmd == "stat":
        print(json.dumps(cd.stat(), indent=1))
    elif cmd == "verify":
        bad = cd.verify(drop=args.drop)
        for r in bad:
            print(f"damaged: {r.key} (segment {r.segment}, offset {r.offset})")
        print(f"{len(bad)} damaged record(s)" + (" deleted" if args.drop and bad else ""))
        return 1 if bad and not args.drop else 0
    elif cmd == "pin":
        n = cd.pin(args.label, _token_ids(args), block_tokens=args.block_tokens, salt=args.salt)
        print(f"pinned {n} block(s) as {args.label!r}")
    elif cmd == "unpin":
        cd.unpin(args.label)
        print(f"unpinned {args.label!r}")
    elif cmd == "evict":
        print(f"evicted {cd.evict(identity=args.identity, older_than_s=args.older_than)} record(s)")
    return 0
