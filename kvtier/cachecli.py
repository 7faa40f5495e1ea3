"""`kvtier cache clear DIR`: give back the disk space of an L3 directory (segments, index, lock)."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="cache_command", required=True)
    c = sub.add_parser("clear", help="delete an L3 directory's records and files (refused while in use)")
    c.add_argument("dirs", nargs="+", metavar="DIR", help="a disk_path kvtier used")


def run(args: argparse.Namespace) -> int:
    from kvtier.tiers import DirectoryLockedError
    from kvtier.tiers.disk import purge_directory

    for d in args.dirs:
        try:
            files, freed = purge_directory(d)
        except DirectoryLockedError as e:
            raise ValueError(str(e)) from e
        print(f"{d}: removed {files} segment file(s), {freed:,} bytes freed")
    return 0
