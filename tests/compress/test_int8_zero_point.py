"""int8 with a zero point (asymmetric uint8 codes): the reference's error bound, the CPU kernel
bit for bit against it, records of either int8 form read by either codec (old records included),
and the config field that chooses it per role."""
import pytest
import torch

from kvtier.compress import cpu, get_codec, pack_record, unpack_record
from kvtier.compress import reference as R
from kvtier.config import KVTierConfig

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def offset_kv(shape, seed=0, dtype=torch.bfloat16):
    """Values whose channels sit off zero (as post-RoPE keys' slow channels do within a block)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) + 4 * torch.randn(shape[-1], generator=g)).to(dtype)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_reference_error_is_within_half_a_step(dtype, axis):
    x = offset_kv((3, 64, 64), dtype=dtype)
    q, scale, zero = R.quantize_ref(x, R.ASYM8, 32, axis)
    assert q.dtype == torch.uint8 and q.shape == x.shape and zero.dtype == dtype
    y = R.dequantize_ref(q, scale, zero, R.ASYM8, 32, axis, tuple(x.shape), dtype)
    dim = -1 if axis == "token" else -2
    step = scale.float().repeat_interleave(32, dim=dim)  # [3, 64, 64]
    # half a step of the codes, the rounding of scale and zero to the dtype (the top of the range
    # may clamp by that much), and the final rounding of the output to the dtype
    eps = torch.finfo(dtype).eps
    bound = 0.5 * step + x.float().abs() * eps + 256 * step * eps + 1e-6
    assert ((y.float() - x.float()).abs() <= bound).all()
    sym = R.dequantize_ref(*R.quantize_ref(x, 8, 32, axis), 8, 32, axis, tuple(x.shape), dtype)
    # the step is never coarser ((max - min) / 255 <= 2 absmax / 255); per-channel groups of
    # offset channels are where the symmetric codes waste most of their range
    assert rel_err(y, x) < (0.75 if axis == "channel" else 1.0) * rel_err(sym, x)


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("shape,g", [((6, 64, 64), 32), ((2, 40, 80), 32), ((3, 64, 48), 64), ((1, 7, 128), 128)])
def test_cpu_kernel_equals_reference(dtype, axis, shape, g):
    x = offset_kv(shape, seed=sum(shape), dtype=dtype)
    ref = R.quantize_ref(x, R.ASYM8, g, axis)
    got = cpu.quantize(x.contiguous(), R.ASYM8, g, axis)
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype and torch.equal(a, b)
    y_ref = R.dequantize_ref(*ref, R.ASYM8, g, axis, shape, dtype)
    assert torch.equal(cpu.dequantize(*ref, R.ASYM8, g, axis, shape, dtype), y_ref)


def test_constant_and_nonfinite_groups():
    x = torch.full((2, 64, 64), -0.75, dtype=torch.bfloat16)
    c = get_codec("int8", group_size=32, axis="channel", zero_point=True)
    assert torch.equal(c.decode(c.encode(x)), x)  # scale 1, every code 0, the zero exact
    x[0, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        c.encode(x)


@pytest.mark.parametrize("version", [1, 2])
def test_either_int8_codec_reads_either_form(version):
    x = offset_kv((3, 64, 64))
    sym = get_codec("int8", group_size=32, axis="channel")
    asym = get_codec("int8", group_size=32, axis="channel", zero_point=True)
    es, ea = sym.encode(x), asym.encode(x)
    assert ea.params == {"group_size": 32, "axis": "channel", "zero_point": 1}
    assert es.params == {"group_size": 32, "axis": "channel"}  # records as before
    assert ea.nbytes - es.nbytes == ea.parts["zero"].numel() * 2  # one 16-bit zero per group
    for enc, own in ((es, sym), (ea, asym)):
        back = unpack_record(pack_record(enc, version=version))
        y = own.decode(enc)
        assert torch.equal(sym.decode(back), y) and torch.equal(asym.decode(back), y)
    assert rel_err(asym.decode(ea), x) < 0.75 * rel_err(sym.decode(es), x)


def test_bad_zero_point_param_in_a_record_is_refused():
    c = get_codec("int8", group_size=32, axis="channel", zero_point=True)
    enc = c.encode(offset_kv((3, 64, 64)))
    bad = type(enc)(enc.codec, {**enc.params, "zero_point": 2}, enc.shape, enc.dtype, enc.parts)
    with pytest.raises(ValueError, match="zero_point"):
        c.decode(bad)


def test_get_codec_checks_zero_point():
    with pytest.raises(ValueError, match="zero_point must be True or False"):
        get_codec("int8", group_size=32, zero_point=1)
    with pytest.raises(ValueError, match="zero_point is an int8 option"):
        get_codec("int4", group_size=32, zero_point=True)


@pytest.mark.parametrize("setting,key,value", [("none", False, False), ("key", True, False),
                                               ("value", False, True), ("both", True, True)])
def test_config_chooses_the_zero_point_per_role(setting, key, value):
    cfg = KVTierConfig(int8_zero_point=setting)
    assert cfg.codec_kwargs("int8", "key").get("zero_point", False) is key
    assert cfg.codec_kwargs("int8", "value").get("zero_point", False) is value
    assert "zero_point" not in cfg.codec_kwargs("int4", "key")  # other codecs ignore it


@pytest.mark.parametrize("bad", ["keys", "", None, True, 1])
def test_config_rejects_bad_zero_point(bad):
    with pytest.raises(ValueError, match="int8_zero_point must be one of 'none', 'key', 'value', 'both'"):
        KVTierConfig(int8_zero_point=bad)
