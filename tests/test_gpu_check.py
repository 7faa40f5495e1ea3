"""bench/gpu_check.py runs where no GPU is: its CPU path, and its Triton scorer stage under
Triton's interpreter (the check itself, not the GPU timing), so the script a GPU session runs
is known to work before one is lent."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_path_and_interpreted_scorer_pass():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--skip-model"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS scorer: Triton selection and estimate == torch's" in proc.stdout
    assert "0 failed" in proc.stdout
