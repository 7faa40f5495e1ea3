"""The Hadamard key transform: orthogonal, its own inverse, the same bits from the compiled
kernel and the torch operations, and a codec parameter that records carry."""
import pytest
import torch

from kvtier.compress import cpu, get_codec
from kvtier.compress import codecs as C
from kvtier.compress.rotation import hadamard, hadamard_block, hadamard_ref

needs_kernel = pytest.mark.skipif(not cpu.available(), reason="needs the compiled CPU kernel")


@pytest.mark.parametrize("d", [64, 128, 80, 96, 8])
def test_the_matrix_is_orthogonal_and_its_own_inverse(d):
    eye = torch.eye(d)
    h = hadamard_ref(eye)  # the rows of H (H is symmetric)
    assert torch.allclose(h @ h.T, eye, atol=1e-6)
    assert torch.allclose(h, h.T)
    b = hadamard_block(d)
    assert d % b == 0 and b & (b - 1) == 0
    # block diagonal: nothing mixes across blocks of b channels
    assert torch.count_nonzero(h) == d * b
    x = torch.randn(4, 16, d)  # the transform computes in float32
    assert torch.allclose(hadamard_ref(hadamard_ref(x)), x, atol=1e-5)
    assert torch.allclose(hadamard_ref(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 80, 96])
def test_compiled_kernel_gives_the_reference_bits(dtype, d):
    x = (torch.randn(3, 40, d, generator=torch.Generator().manual_seed(d)) * 5).to(dtype)
    want = hadamard_ref(x)
    assert torch.equal(hadamard(x), want)  # the compiled kernel on contiguous CPU tensors
    y = x.clone()
    assert hadamard(y, out=y) is y and torch.equal(y, want)  # in place


def _keys(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, 64, generator=g)
    x[..., 3] *= 30  # a few wide channels, as post-RoPE keys have
    x[..., 40] += 12
    return x.to(dtype)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_round_trip_and_params(name, axis):
    x = _keys()
    plain = get_codec(name, group_size=32, axis=axis)
    rot = get_codec(name, group_size=32, axis=axis, transform="hadamard")
    enc = rot.encode(x)
    assert enc.params["transform"] == "hadamard" and "transform" not in plain.params
    y = rot.decode(enc)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert _rel(y, x) < {"int8": 0.02, "int4": 0.15, "int2": 0.6}[name]
    if axis == "token":  # per-token groups: wide channels set every group's range unless spread
        assert _rel(y, x) < 0.7 * _rel(plain.decode(plain.encode(x)), x)
    # the decoder follows the record: either codec reads the other's records, the same bits
    assert torch.equal(plain.decode(enc), y)
    assert torch.equal(rot.decode(plain.encode(x)), plain.decode(plain.encode(x)))


@needs_kernel
@pytest.mark.parametrize("name", ["int4", "int2"])
def test_torch_path_gives_the_compiled_paths_bits(name, monkeypatch):
    """The torch operations (what runs on CUDA and without a C compiler) against the compiled
    kernels: the same codes, scales, zeros and decoded values."""
    x = _keys(torch.float16)
    codec = get_codec(name, group_size=32, axis="channel", transform="hadamard", encoder="minmax")
    fast = codec.encode(x)
    fast_y = codec.decode(fast)
    monkeypatch.setattr(C._cpu, "available", lambda: False)
    slow = get_codec(name, group_size=32, axis="channel", transform="hadamard", encoder="minmax").encode(x)
    for part in fast.parts:
        assert torch.equal(fast.parts[part], slow.parts[part]), part
    assert torch.equal(get_codec(name, group_size=32, axis="channel", transform="hadamard").decode(slow), fast_y)


def test_bad_transforms_are_refused():
    with pytest.raises(ValueError, match="transform must be one of"):
        get_codec("int4", transform="rotate")
    with pytest.raises(ValueError, match="transform must be 'none' unless"):
        get_codec("bf16", transform="hadamard")
    enc = get_codec("int4", axis="channel", transform="hadamard").encode(_keys())
    enc.params["transform"] = "other"
    with pytest.raises(ValueError, match="transform"):
        get_codec("int4", axis="channel").decode(enc)
