"""The torch reference: the arithmetic every fast path is held to."""
import math

import pytest
import torch

from kvtier.compress import reference as R


def test_pack_unpack_roundtrip_odd_width():
    g = torch.Generator().manual_seed(0)
    for bits in (4, 2):
        q = torch.randint(0, 1 << bits, (3, 5, 7), generator=g, dtype=torch.uint8)
        p = R.pack_ref(q, bits)
        assert p.shape == (3, 5, math.ceil(7 * bits / 8))
        assert torch.equal(R.unpack_ref(p, bits, 7), q)


def test_pack_layout_is_low_nibble_first():
    q = torch.tensor([[1, 2, 3]], dtype=torch.uint8)
    assert R.pack_ref(q, 4).tolist() == [[1 | 2 << 4, 3]]
    q = torch.tensor([[1, 2, 3, 0, 3]], dtype=torch.uint8)
    assert R.pack_ref(q, 2).tolist() == [[1 | 2 << 2 | 3 << 4, 3]]


def test_int8_token_axis_values_and_error_bound():
    x = torch.tensor([[[1.0, -2.0, 0.5, 0.25]]], dtype=torch.float32)  # [1, 1, 4]
    q, s, z = R.quantize_ref(x, 8, 32, "token")
    assert z is None
    assert s.shape == (1, 1, 1) and s.item() == pytest.approx(2.0 / 127)
    assert q.tolist() == [[[64, -127, 32, 16]]]  # 1.0 * (1 / (2/127)) is 63.5 up to rounding -> 64
    y = R.dequantize_ref(q, s, z, 8, 32, "token", tuple(x.shape), x.dtype)
    assert (y - x).abs().max() <= s.item() / 2 + 1e-7


def test_short_last_group_uses_only_its_own_elements():
    # D = 40 with G = 32: group 1 holds channels 32..39 only.
    x = torch.zeros(1, 2, 40)
    x[..., :32] = 100.0
    x[..., 32:] = torch.linspace(-1, 1, 8)
    q, s, z = R.quantize_ref(x, 4, 32, "token")
    assert s.shape == (1, 2, 2)
    assert s[0, 0, 1].item() == pytest.approx(2.0 / 15)
    assert z[0, 0, 1].item() == pytest.approx(-1.0)
    # channel axis with T = 37, G = 32: the second token group has 5 tokens
    x = torch.randn(2, 37, 8)
    q, s, z = R.quantize_ref(x, 4, 32, "channel")
    assert s.shape == (2, 2, 8)
    assert torch.equal(z[:, 1], x[:, 32:].amin(1))


def test_constant_group_is_exact_and_scale_one():
    x = torch.full((1, 64, 64), 0.75, dtype=torch.float16)
    for bits in (8, 4, 2):
        for axis in ("token", "channel"):
            q, s, z = R.quantize_ref(x, bits, 64, axis)
            y = R.dequantize_ref(q, s, z, bits, 64, axis, tuple(x.shape), x.dtype)
            assert torch.equal(y, x), (bits, axis)
    zeros = torch.zeros(1, 8, 64)
    q, s, z = R.quantize_ref(zeros, 8, 64, "token")
    assert torch.all(s == 1) and torch.all(q == 0)


@pytest.mark.parametrize("bits,bound", [(8, 0.5), (4, 0.5), (2, 0.5)])
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_error_within_half_step(bits, bound, axis):
    x = torch.randn(3, 64, 64, generator=torch.Generator().manual_seed(1))
    q, s, z = R.quantize_ref(x, bits, 32, axis)
    y = R.dequantize_ref(q, s, z, bits, 32, axis, tuple(x.shape), x.dtype)
    step = s.repeat_interleave(32, dim=-1) if axis == "token" else s.repeat_interleave(32, dim=-2)
    assert torch.all((y - x).abs() <= step * bound * (1 + 1e-5) + 1e-6)
