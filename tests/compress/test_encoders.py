"""The int4/int2 encoders: ``mse`` refines scale/zero under the same record layout as ``minmax``."""
import pytest
import torch

from kvtier.compress import get_codec, pack_record, unpack_record
from kvtier.compress import reference as R


def data(seed, shape=(3, 64, 64), dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 3] *= 20.0  # an outlier channel, as real keys have
    x[..., 1, :] += 8.0  # and an outlier token
    return x.to(dtype)


def group_sq_err(x, enc, bits, group_size, axis):
    """Squared error per group ([B, R, ng]) of an encoding of ``x``."""
    y = R.dequantize_ref(enc[0], enc[1], enc[2], bits, group_size, axis, tuple(x.shape), torch.float32)
    d = (y - x.float()).reshape(-1, *x.shape[-2:]) ** 2  # [B, T, D]
    g, n = R._grouped(d, group_size, axis)  # [B, R, ng, G]
    if g.shape[-1] * g.shape[-2] != n:  # the replicated padding of the last group counts once
        mask = (torch.arange(g.shape[-2] * g.shape[-1]) < n).float().view(g.shape[-2], g.shape[-1])
        g = g * mask
    return g.sum(-1)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("shape", [(3, 64, 64), (2, 80, 64)], ids=["full", "short-last-group"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_mse_is_never_worse_than_minmax_per_group(bits, axis, shape, dtype):
    x = data(bits + len(axis), shape, dtype)
    a = R.quantize_ref(x, bits, 32, axis, encoder="minmax")
    b = R.quantize_ref(x, bits, 32, axis, encoder="mse")
    ea, eb = group_sq_err(x, a, bits, 32, axis), group_sq_err(x, b, bits, 32, axis)
    assert bool((eb <= ea * (1 + 1e-6) + 1e-12).all())
    assert eb.sum() < 0.97 * ea.sum()  # and it finds something on this data


@pytest.mark.parametrize("bits", [4, 2])
def test_mse_codes_follow_the_reference_formula(bits):
    # The decoders and the kernels' codes are defined by (scale, zero): recomputing the codes of
    # an mse encoding with the spec's arithmetic gives exactly its codes.
    x = data(7)
    q, s, z = R.quantize_ref(x, bits, 32, "channel", encoder="mse")
    g, n = R._grouped(x.reshape(-1, 64, 64).float(), 32, "channel")  # [B, D, ng, G]
    st = s.reshape(-1, 2, 64).transpose(1, 2).float().unsqueeze(-1)  # [B, D, ng, 1]
    zt = z.reshape(-1, 2, 64).transpose(1, 2).float().unsqueeze(-1)
    codes = R._codes(g, st, zt, R.qmax(bits)).reshape(-1, 64, 64).transpose(1, 2)  # [B, T, D]
    assert torch.equal(R.unpack_ref(q, bits, 64), codes.to(torch.uint8))


@pytest.mark.parametrize("name", ["int4", "int2"])
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_mse_encoding_decodes_alike_everywhere(name, axis):
    # same parts, same params, same record: the CPU kernel decodes it bit-exactly as the reference
    bits = int(name[3:])
    x = data(11, (3, 64, 64), torch.float16)
    c = get_codec(name, group_size=64, axis=axis, encoder="mse")
    enc = c.encode(x)
    assert enc.params == get_codec(name, group_size=64, axis=axis, encoder="minmax").encode(x).params
    ref = R.dequantize_ref(enc.parts["q"], enc.parts["scale"], enc.parts["zero"], bits, 64, axis,
                           tuple(x.shape), x.dtype)
    assert torch.equal(c.decode(enc), ref)
    back = unpack_record(pack_record(enc))
    assert torch.equal(get_codec(name, group_size=64, axis=axis, encoder="minmax").decode(back), ref)


def test_encoder_defaults_and_validation():
    # measured defaults: only int2 keys (per-channel groups) are refined
    assert get_codec("int2", axis="channel").encoder == "mse"
    assert get_codec("int2", axis="token").encoder == "minmax"
    assert get_codec("int4", axis="channel").encoder == "minmax" and get_codec("int4").encoder == "minmax"
    assert get_codec("int8").encoder == "minmax"
    assert get_codec("int2", axis="token", encoder="mse").encoder == "mse"
    assert get_codec("int4", encoder="minmax").encoder == "minmax"
    with pytest.raises(ValueError, match="encoder"):
        get_codec("int4", encoder="hqq")
    with pytest.raises(ValueError, match="encoder"):
        get_codec("int8", encoder="mse")


def test_mse_rejects_nonfinite_and_constant_groups_are_exact():
    x = data(3, dtype=torch.float16)
    x[0, 5, 7] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        get_codec("int4", encoder="mse").encode(x)
    c = torch.full((3, 64, 64), 1.5, dtype=torch.bfloat16)
    for name in ("int4", "int2"):
        codec = get_codec(name, group_size=32, axis="channel", encoder="mse")
        assert torch.equal(codec.decode(codec.encode(c)), c)


def test_mse_lowers_error_on_real_like_keys_and_values():
    # roles as the store encodes them (keys per channel, values per token), int4 and int2
    x = data(5, (3, 64, 64), torch.bfloat16)
    for name, axis in (("int4", "channel"), ("int4", "token"), ("int2", "channel"), ("int2", "token")):
        errs = {}
        for enc in ("minmax", "mse"):
            c = get_codec(name, group_size=32, axis=axis, encoder=enc)
            errs[enc] = (c.decode(c.encode(x)).float() - x.float()).norm().item()
        assert errs["mse"] < errs["minmax"]


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_compiled_mse_matches_the_reference(bits, axis, dtype):
    # Same steps and fp32 arithmetic; only the order of the sums may differ, which moves a
    # float32 pair by its last bits and, rarely, a 16-bit one: the total error agrees to 1e-3
    # and no group is worse than min/max.
    from kvtier.compress import cpu

    if not cpu.available():
        pytest.skip(f"no C kernel: {cpu.build_error()}")
    x = data(21, (2, 3, 80, 64), dtype)  # a short last group along tokens
    q, s, z = R.quantize_ref(x, bits, 32, axis, encoder="mse")
    cq, cs, cz, bad = cpu.quantize_mse_checked(x.contiguous(), bits, 32, axis)
    assert not bad and cq.shape == q.shape and cs.shape == s.shape and cs.dtype == s.dtype
    if dtype != torch.float32:
        assert ((cs == s) & (cz == z)).float().mean() >= 0.99
    e_ref = group_sq_err(x, (q, s, z), bits, 32, axis).sum()
    e_c = group_sq_err(x, (cq, cs, cz), bits, 32, axis).sum()
    assert abs(e_c / e_ref - 1) < 1e-3
    e_minmax = group_sq_err(x, R.quantize_ref(x, bits, 32, axis), bits, 32, axis)
    assert bool((group_sq_err(x, (cq, cs, cz), bits, 32, axis) <= e_minmax * (1 + 1e-6) + 1e-12).all())
    y = get_codec(f"int{bits}", group_size=32, axis=axis, encoder="mse").encode(x)
    assert torch.equal(y.parts["q"], cq) and torch.equal(y.parts["scale"], cs)  # the codec's CPU path
    x[1, 2, 3, 4] = float("inf")
    assert cpu.quantize_mse_checked(x.contiguous(), bits, 32, axis)[3]


def test_reference_and_kernel_follow_the_search_settings_alike(monkeypatch):
    # FIT_ITERS and SHRINK are read at each call by both the reference and the compiled kernel,
    # so a changed search is the same search everywhere (and a longer one is never worse)
    from kvtier.compress import cpu

    x = data(9, (3, 64, 64), torch.bfloat16)
    base = group_sq_err(x, R.quantize_ref(x, 2, 32, "channel", encoder="mse"), 2, 32, "channel").sum()
    monkeypatch.setattr(R, "FIT_ITERS", 4)
    monkeypatch.setattr(R, "SHRINK", (0.9, 0.8))
    ref = R.quantize_ref(x, 2, 32, "channel", encoder="mse")
    longer = group_sq_err(x, ref, 2, 32, "channel").sum()
    assert longer < base
    if cpu.available():
        cq, cs, cz, _ = cpu.quantize_mse_checked(x.contiguous(), 2, 32, "channel")
        assert abs(group_sq_err(x, (cq, cs, cz), 2, 32, "channel").sum() / longer - 1) < 1e-3
