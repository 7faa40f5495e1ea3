"""Command-line entry points: `kvtier eval`, `kvtier plan`, `kvtier generate`, `kvtier cache`."""
from __future__ import annotations

import argparse
import os
import sys

# Before torch loads: idle OpenMP threads sleep instead of spinning, which on a shared machine
# (another process on the same cores) avoids slow-downs of up to 10x.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered, quantized KV cache for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    from kvtier.eval import cli as eval_cli

    p = sub.add_parser("eval", help="accuracy against footprint of cache configurations, side by side")
    eval_cli.add_arguments(p)
    p.set_defaults(func=eval_cli.run)

    from kvtier import plan

    p = sub.add_parser("plan", help="KV size per token/sequence and recommended tier sizes")
    plan.add_arguments(p)
    p.set_defaults(func=plan.run)

    from kvtier.integrations import chat

    p = sub.add_parser("generate", help="chat with the embedded model through a kvtier cache")
    chat.add_arguments(p)
    p.set_defaults(func=chat.run)

    from kvtier import cachecli

    p = sub.add_parser("cache", help="manage L3 directories on disk (cache clear DIR)")
    cachecli.add_arguments(p)
    p.set_defaults(func=cachecli.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        parser.exit(2, f"kvtier {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
