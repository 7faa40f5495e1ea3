"""Integer key codecs that keep their widest channels exactly (``outliers``): round trips,
partial blocks, the record format, records of another count, bad input."""
import pytest
import torch

from kvtier.compress import get_codec, pack_record, unpack_record


def roped_keys(heads=3, tokens=64, dim=64, start=0, seed=0, dtype=torch.bfloat16):
    """Keys shaped like a RoPE model's: per-channel offsets and a few large channels before the
    rotation (as KVQuant observed pre-RoPE), then rotated by positions ``start ..``."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(heads, 1, dim, generator=g)
    mean[:, :, [1, 2, 33, 34]] *= 12  # large pairs in fast-rotating channels (i and i + 32 pair up)
    pre = mean + 0.3 * torch.randn(heads, tokens, dim, generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    f = torch.arange(start, start + tokens).float()[:, None] * inv[None]  # transformers' rotate_half
    cos, sin = f.cos(), f.sin()
    lo, hi = pre[..., :dim // 2], pre[..., dim // 2:]
    return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], -1).to(dtype)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["int2", "int4", "int8"])
def test_kept_channels_are_exact_and_lower_the_error(name, dtype):
    x = roped_keys(dtype=dtype)
    plain = get_codec(name, group_size=32, axis="channel")
    kept = get_codec(name, group_size=32, axis="channel", outliers=4)
    e0, e = plain.encode(x), kept.encode(x)
    y0, y = plain.decode(e0), kept.decode(e)
    assert y.dtype == dtype and y.shape == x.shape
    assert e.params == {"group_size": 32, "axis": "channel", "outliers": 4} and "outliers" not in e0.params
    idx = e.parts["oidx"]
    assert idx.shape == (3, 4) and idx.dtype == torch.uint8
    for h in range(3):  # the widest channels are kept, bit for bit
        width = x[h].float().amax(0) - x[h].float().amin(0)
        assert set(idx[h].tolist()) == set(width.topk(4).indices.tolist())
        assert torch.equal(y[h][:, idx[h].long()], x[h][:, idx[h].long()])
    assert rel_err(y, x) < 0.6 * rel_err(y0, x)
    # bytes: the plain parts plus n values per token and one index byte per kept channel
    assert e.nbytes == e0.nbytes + 3 * 4 * (64 * x.element_size() + 1)


@pytest.mark.parametrize("shape", [(2, 3, 40, 64), (1, 7, 80), (3, 64, 16)])
def test_partial_blocks_and_more_leading_dims(shape):
    """A short last group (40 tokens, groups of 32), a K+V stack, head_dim not a multiple of the
    group: the kept channels are per [T, D] matrix."""
    x = torch.randn(shape).to(torch.float16)
    c = get_codec("int2", group_size=32, axis="channel", outliers=3)
    e = c.encode(x)
    y = c.decode(e)
    assert e.parts["oidx"].shape == (*shape[:-2], 3) and e.parts["oval"].shape == (*shape[:-1], 3)
    flat_y, flat_x = y.reshape(-1, *shape[-2:]), x.reshape(-1, *shape[-2:])  # [matrices, T, D]
    for b, i in enumerate(e.parts["oidx"].reshape(-1, 3)):
        assert torch.equal(flat_y[b][:, i.long()], flat_x[b][:, i.long()])


def test_record_round_trip_and_any_count_decodes():
    """The count travels in the record header: a codec built with another count (or none)
    decodes it the same, and a plain record decodes with a codec that keeps channels."""
    x = roped_keys(dtype=torch.float16)
    kept = get_codec("int2", group_size=32, axis="channel", outliers=4)
    plain = get_codec("int2", group_size=32, axis="channel")
    e = kept.encode(x)
    r = unpack_record(pack_record(e))
    assert r.params == e.params
    assert torch.equal(plain.decode(r), kept.decode(e))
    e0 = plain.encode(x)
    assert torch.equal(kept.decode(unpack_record(pack_record(e0))), plain.decode(e0))


@pytest.mark.parametrize("kwargs,field", [
    (dict(name="int2", outliers=-1), "outliers"),
    (dict(name="int2", outliers=33), "outliers"),
    (dict(name="int2", outliers=True), "outliers"),
    (dict(name="int2", outliers="4"), "outliers"),
    (dict(name="int2", outliers=4, axis="token"), "outliers must be 0"),
    (dict(name="bf16", outliers=4, axis="channel"), "outliers must be 0"),
    (dict(name="nf4", outliers=4, axis="channel"), "outliers must be 0"),
])
def test_get_codec_rejects_bad_outliers(kwargs, field):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=field):
        get_codec(name, group_size=32, **kwargs)


def test_more_kept_channels_than_head_dim_is_refused():
    with pytest.raises(ValueError, match="outliers must be <= head_dim"):
        get_codec("int2", group_size=32, axis="channel", outliers=8).encode(torch.randn(2, 32, 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_encode_matches_cpu():
    x = roped_keys(dtype=torch.float16)
    c = get_codec("int2", group_size=32, axis="channel", outliers=4, encoder="minmax")
    e, ec = c.encode(x), c.encode(x.cuda())
    assert torch.equal(e.parts["oidx"], ec.parts["oidx"].cpu()) and torch.equal(e.parts["oval"], ec.parts["oval"].cpu())
    assert torch.equal(c.decode(ec, device="cpu"), c.decode(e))
