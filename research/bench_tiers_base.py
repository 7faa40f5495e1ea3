"""bench/bench_tiers.py with an older revision's DiskTier measured beside this tree's, same run.

Decided (2026-12-01): with ``--base-rev acc91f9`` (the DiskTier before cooperative compaction
and pread-served small records), that compacting in paced GIL-releasing steps and reading a
record with one ``pread`` go in (commit 4dfc4f3: the decode-shaped compaction step beside the
micro step, this tree against the base); with ``--reopen-rev d8a714b`` (whose checkpoint loads
into a dict of tuples, one object per record), that the index stays a dict over the
checkpoint's arrays (commit 789db4b: reopening 1M records builds no object per record). The
C record reader's figures in docs/architecture.md (the Python path of f14c39e in brackets)
were measured with ``--only L3 --base-rev f14c39e``.

The older revision's ``kvtier/tiers`` is copied out of git into the run's temporary folder
and imported beside the current package; the measurements are bench_tiers's own (its
``base_*`` keys, ``Base`` lines in the VERDICTs, ``base`` in L3_reopen). Without the git
history the run measures this tree alone.

    python research/bench_tiers_base.py --only L3 --base-rev f14c39e
    python research/bench_tiers_base.py --only compaction --only reopen
    python research/bench_tiers_base.py --smoke
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "bench"))

import bench_tiers  # noqa: E402

L3_BASE = "acc91f9"  # the DiskTier before cooperative compaction and pread-served small records
REOPEN_BASE = "d8a714b"  # the DiskTier whose checkpoint loads into a dict of tuples (one object per record)


def tiers_at(rev: str, root: str, name: str) -> str | None:
    """kvtier/tiers as of git ``rev``, copied into ``root``/``name`` (a package importable beside
    the current one); ``root``, or None when there is no git history to take it from."""
    ls = subprocess.run(["git", "-C", _ROOT, "ls-tree", "--name-only", rev, "kvtier/tiers/"], capture_output=True,
                        text=True)
    if ls.returncode != 0 or not ls.stdout.strip():
        return None
    pkg = os.path.join(root, name)
    os.makedirs(pkg, exist_ok=True)
    for path in ls.stdout.split():
        if path.endswith(".py"):
            src = subprocess.run(["git", "-C", _ROOT, "show", f"{rev}:{path}"], capture_output=True, text=True,
                                 check=True).stdout
            with open(os.path.join(pkg, os.path.basename(path)), "w") as f:
                f.write(src)
    return root


def import_tiers_at(rev: str, root: str):
    """kvtier.tiers as of git ``rev`` (a module), or None without the git history."""
    pkgdir = tiers_at(rev, root, "kvtier_tiers_l3base")
    if pkgdir is None:
        return None
    sys.path.insert(0, pkgdir)
    try:
        return importlib.import_module("kvtier_tiers_l3base")
    finally:
        sys.path.remove(pkgdir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Every other option is bench/bench_tiers.py's (--smoke, --only, ...).")
    ap.add_argument("--base-rev", default=L3_BASE,
                    help="git revision whose DiskTier the L3 reads (base_read_*) and compaction steps also run on")
    ap.add_argument("--reopen-rev", default=REOPEN_BASE,
                    help="git revision whose DiskTier reopens the same records beside this tree's")
    a, rest = ap.parse_known_args(argv)

    def base(root: str) -> bench_tiers.Base:
        # the reopen's package name is fixed: its child interpreter imports kvtier_tiers_base
        return bench_tiers.Base(label=a.base_rev, tiers=import_tiers_at(a.base_rev, root),
                                reopen_label=a.reopen_rev, reopen_dir=tiers_at(a.reopen_rev, root, "kvtier_tiers_base"))

    return bench_tiers.main(rest, base=base)


if __name__ == "__main__":
    sys.exit(main())
