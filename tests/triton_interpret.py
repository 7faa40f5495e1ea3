"""Run a check script under Triton's interpreter and read back its per-case results.

TRITON_INTERPRET must be set before triton is first imported (triton.language's own @jit helpers
are decorated at import), so the kernels' CPU checks run in a subprocess that prints one JSON
object: case id -> "ok" or a description of the first mismatch."""
import json
import os
import subprocess
import sys
from pathlib import Path


def run_interpreted(script: Path) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)
