"""The Triton kernels, run on CPU by Triton's interpreter, against the torch reference.

TRITON_INTERPRET must be set before triton is first imported, so the comparisons run in a
subprocess (``_triton_interpret_check.py``); each case is reported here as its own test.
"""
import itertools
from pathlib import Path

import pytest

from tests.triton_interpret import run_interpreted

pytest.importorskip("triton")

ALL = ("3x64x64-g64", "2x37x128-g32", "5x80-g32", "1x7x3-g128", "2x2x65x64-g128")
SHAPES = {"float16": ALL, "bfloat16": (ALL[0], ALL[1], ALL[3]), "float32": (ALL[2], ALL[4])}
CODECS = ("int8", "int4", "int2", "int8z")  # int8z: int8 with a zero point (uint8 codes)
IDS = [f"{d}-{c}-{a}-{s}"
       for d in SHAPES for c, a, s in itertools.product(CODECS, ("token", "channel"), SHAPES[d])]
IDS += [f"constant-{c}-{a}" for c, a in itertools.product(CODECS, ("token", "channel"))]


@pytest.fixture(scope="module")
def results():
    return run_interpreted(Path(__file__).with_name("_triton_interpret_check.py"))


def test_every_case_ran(results):
    assert sorted(results) == sorted(IDS)


@pytest.mark.parametrize("case", IDS)
def test_bit_identical_to_reference(results, case):
    assert results[case] == "ok", results[case]
