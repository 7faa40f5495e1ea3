"""`kvtier cache clear DIR`: give back the disk space of an L3 directory (segments, index, lock)."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    # no subcommand prints this command's help (run() below) rather than argparse's terse error
    sub = p.add_subparsers(dest="cache_command", required=False)
    c = sub.add_parser("clear", help="delete an L3 directory's records and files (refused while in use)")
    c.add_argument("dirs", nargs="+", metavar="DIR", help="a disk_path kvtier used")


def run(args: argparse.Namespace) -> int:
    from kvtier.tiers import DirectoryLockedError
    from kvtier.tiers.disk import purge_directory

    if args.cache_command is None:
        args.parser.print_help()
        return 0
    for d in args.dirs:
        try:
            files, freed = purge_directory(d)
        except DirectoryLockedError as e:
            raise ValueError(str(e)) from e
        except PermissionError as e:
            raise ValueError(f"{d}: cannot remove its files ({e.strerror}: {e.filename}); "
                             f"the directory or its files are not writable by this user") from None
        except OSError as e:
            raise ValueError(f"{d}: cannot clear it ({e.strerror or e})") from None
        print(f"{d}: removed {files} segment file(s), {freed:,} bytes freed")
    return 0
