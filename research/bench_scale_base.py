"""bench/bench_scale.py with an older revision's store run beside this tree's, same machine, same run.

Decided (2026-12-01): with ``--reopen-rev a4e1479`` (the DiskTier that reopened by scanning its
whole log), that L3 reopens from an index checkpoint (commit 8319f32: 1M records reopened
against that code and against a full scan by the current code); with ``--base REV`` on the
grow workload, that reads keep the decoded data of blocks swapped into scratch slots for the
next step instead of reading and decoding them again (commit 35063b2: the steps after a
prefill measured apart from the steady ones, old and new store side by side).

``--base``: the older revision's ``kvtier`` package is exported with ``git archive`` and runs
bench_scale.py's grow workload in a child process first (its memory gone before this tree's
run); ``--reopen-rev``: that revision's ``kvtier/tiers/disk.py`` reopens the same records
before the checkpoint and scan runs. Without the git history the run measures this tree alone.

    python research/bench_scale_base.py --base a4e1479 --only grow --dir /mnt/ssd/kvtier-scale
    python research/bench_scale_base.py --only reopen
    python research/bench_scale_base.py --smoke --base HEAD
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BENCH = os.path.join(_ROOT, "bench", "bench_scale.py")
sys.path.insert(0, os.path.dirname(_BENCH))

import bench_scale  # noqa: E402

REOPEN_BASE = "a4e1479"  # the DiskTier that reopened by scanning its whole log (no checkpoint)


def run_grow_base(rev: str, a, root: str) -> dict:
    """The grow workload with the store of git revision ``rev`` (its kvtier package exported
    next to the run, bench_scale.py's workload and measurement), in a child process: old and
    new store side by side in one run, on the same machine and disk."""
    src = os.path.join(root, "base-src")
    os.makedirs(src)
    commit = subprocess.run(["git", "-C", _ROOT, "rev-parse", "--short", rev], capture_output=True,
                            text=True, check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", _ROOT, "archive", commit, "kvtier"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", src], input=archive.stdout, check=True)
    out_dir = os.path.join(root, "base-out")
    args = ["--only", "grow", "--out", out_dir, "--dir", root, "--shape", a.shape, "--block-tokens",
            str(a.block_tokens), "--max-tokens", str(a.max_tokens), "--steps", str(a.steps), "--codec", a.codec,
            "--l1-gib", str(a.l1_gib), "--l2-gib", str(a.l2_gib), "--disk-gib", str(a.disk_gib),
            "--prefetch-blocks", str(a.prefetch_blocks)] + (["--layers", str(a.layers)] if a.layers else [])
    env = dict(os.environ, PYTHONPATH=src)
    r = subprocess.run([sys.executable, _BENCH] + args, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"the base run ({commit}) failed: {r.stderr[-2000:]}")
    with open(os.path.join(out_dir, "bench_scale.json")) as f:
        got = json.load(f)["grow"]
    got["commit"] = commit
    return got


def disk_at(rev: str, root: str) -> str | None:
    """``kvtier/tiers/disk.py`` as of git ``rev``, written into ``root``; its path, or None
    without the git history."""
    got = subprocess.run(["git", "-C", _ROOT, "show", f"{rev}:kvtier/tiers/disk.py"], capture_output=True, text=True)
    if got.returncode != 0:
        return None
    path = os.path.join(root, "disk_base.py")
    with open(path, "w") as f:
        f.write(got.stdout)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Every other option is bench/bench_scale.py's (--smoke, --only, --dir, ...).")
    ap.add_argument("--base", default=None, metavar="REV",
                    help="also run the grow workload with the store of this git revision (side by side)")
    ap.add_argument("--reopen-rev", default=REOPEN_BASE,
                    help="git revision whose DiskTier reopens the same records first ('' for none)")
    a, rest = ap.parse_known_args(argv)
    base = bench_scale.Base(grow=lambda args, root: run_grow_base(a.base, args, root) if a.base else None,
                            reopen_src=lambda root: disk_at(a.reopen_rev, root) if a.reopen_rev else None)
    return bench_scale.main(rest, base=base)


if __name__ == "__main__":
    sys.exit(main())
