"""The ``kvtier`` command: one subcommand per module of this package (eval, plan, generate, cache)."""
from __future__ import annotations

import argparse
import os
import sys

# Before torch loads: idle OpenMP threads sleep instead of spinning, which on a shared machine
# (another process on the same cores) avoids slow-downs of up to 10x.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def build_parser() -> argparse.ArgumentParser:
    # Each subcommand's module gives add_arguments(parser) and run(args).
    from kvtier import __version__
    from kvtier.commands import cache, generate, plan
    from kvtier.commands import eval as eval_command

    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered, quantized KV cache for LLM inference.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module, summary in (
        ("eval", eval_command, "accuracy against footprint of cache configurations, side by side"),
        ("plan", plan, "KV size per token/sequence and recommended tier sizes"),
        ("generate", generate, "chat with the embedded model through a kvtier cache"),
        ("cache", cache, "inspect and manage L3 directories (ls, stat, verify, pin, evict, clear)"),
    ):
        p = sub.add_parser(name, help=summary, description=summary)
        module.add_arguments(p)
        p.set_defaults(func=module.run, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        parser.exit(2, f"kvtier {args.command}: error: {e}\n")
    except BrokenPipeError:
        # the reader went away (`kvtier plan --json | head`): what it wanted it has; point
        # stdout at /dev/null so the interpreter's final flush does not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
