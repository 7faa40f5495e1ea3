"""The compiled CPU path: bit-identical to the reference on odd shapes, every dtype and axis."""
import itertools

import pytest
import torch

from kvtier.compress import cpu as C
from kvtier.compress import reference as R

pytestmark = pytest.mark.skipif(not C.available(), reason=f"no C compiler: {C.build_error()}")

SHAPES = [(3, 64, 64), (2, 37, 128), (5, 80), (1, 7, 3), (2, 3, 65, 64), (1, 130, 66)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_bit_identical_to_reference(dtype, bits):
    g = torch.Generator().manual_seed(bits)
    for G, axis, shape in itertools.product([32, 64, 128], ["token", "channel"], SHAPES):
        x = (torch.randn(shape, generator=g) * 3).to(dtype)
        ref = R.quantize_ref(x, bits, G, axis)
        got = C.quantize(x, bits, G, axis)
        for name, a, b in zip(("q", "scale", "zero"), ref, got):
            if a is None:
                assert b is None
                continue
            assert a.dtype == b.dtype and a.shape == b.shape, (name, G, axis, shape)
            assert torch.equal(a, b), (name, G, axis, shape)
        ya = R.dequantize_ref(*ref, bits, G, axis, shape, dtype)
        yb = C.dequantize(*ref, bits, G, axis, shape, dtype)
        assert torch.equal(ya, yb), (G, axis, shape)


def test_nonfinite_flagged():
    for bad in (float("nan"), float("inf"), float("-inf")):
        for bits, axis in itertools.product([8, 4, 2], ["token", "channel"]):
            x = torch.randn(2, 64, 64, dtype=torch.float16)
            x[1, 17, 5] = bad
            assert C.quantize_checked(x, bits, 32, axis)[3], (bad, bits, axis)
    assert not C.quantize_checked(torch.randn(2, 64, 64), 4, 32, "token")[3]


def test_out_buffers_are_filled_in_place():
    x = torch.randn(4, 64, 64, dtype=torch.float16)
    q, s, z = C.quantize(x, 4, 64, "channel")
    q2, s2, z2 = torch.empty_like(q), torch.empty_like(s), torch.empty_like(z)
    C.quantize(x, 4, 64, "channel", out=(q2, s2, z2))
    assert torch.equal(q, q2) and torch.equal(s, s2) and torch.equal(z, z2)
    out = torch.empty_like(x)
    y = C.dequantize(q, s, z, 4, 64, "channel", tuple(x.shape), x.dtype, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(out, R.dequantize_ref(q, s, z, 4, 64, "channel", tuple(x.shape), x.dtype))


def test_large_input_uses_threads_and_stays_exact():
    x = torch.randn(6, 512, 128, dtype=torch.bfloat16)  # above the OpenMP threshold
    for bits, axis in itertools.product([8, 4], ["token", "channel"]):
        ref = R.quantize_ref(x, bits, 64, axis)
        got = C.quantize(x, bits, 64, axis)
        assert all(torch.equal(a, b) for a, b in zip(ref, got) if a is not None)
