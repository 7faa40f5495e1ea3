"""`kvtier eval` off a terminal (a log, a pipe, `make demo > log`): a flushed line per step, so a
long run never looks hung, and the machine's dtype rule in the model line."""
from __future__ import annotations

import re

import pytest


@pytest.mark.slow
def test_progress_lines_when_stdout_is_not_a_terminal(tmp_path, capsys):
    from kvtier.commands.cli import main
    from kvtier.hardware import compute_dtype

    argv = ["eval", "--contexts", "256", "--continuation", "4", "--windows", "1", "--no-probe",
            "--only", "kvtier int4 sparse L1=25%", "--threads", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\[\s*\d+ s\] building tasks$", out, re.M)
    want = str(compute_dtype("cpu")).removeprefix("torch.")
    assert re.search(rf"^\[\s*\d+ s\] loading model in {want} \(CPU: .+, native bf16 matmul: (True|False)\)$", out, re.M)
    assert re.search(r"^\[\s*\d+ s\] context 256: kvtier int4 sparse L1=25% done \(2/2\)$", out, re.M)
