"""fp32: the lossless codec for float32 KV (and exact for fp16/bf16 input too)."""
import pytest
import torch

from kvtier.compress import get_codec, pack_record, unpack_record


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp32_round_trip_is_bit_exact(dtype):
    c = get_codec("fp32")
    x = (torch.randn(3, 64, 64) * 7).to(dtype)  # [kv_heads, block_tokens, head_dim]
    x[0, 0, 0] = 1e-30 if dtype == torch.float32 else x[0, 0, 0]  # a float32 subnormal-adjacent value
    enc = c.encode(x)
    assert c.lossless and enc.codec == "fp32" and enc.nbytes == x.numel() * 4
    y = c.decode(unpack_record(pack_record(enc)))
    assert y.dtype == dtype and torch.equal(y.view(torch.uint8), x.view(torch.uint8))
    assert y.data_ptr() != x.data_ptr()


def test_fp16_codec_is_not_lossless_on_float32_kv_and_fp32_is():
    x = torch.randn(2, 3, 64, 64)
    assert not torch.equal(get_codec("fp16").decode(get_codec("fp16").encode(x)), x)
    assert torch.equal(get_codec("fp32").decode(get_codec("fp32").encode(x)), x)


def test_fp32_encode_does_not_alias_or_modify_its_input():
    x = torch.randn(4, 8)
    keep = x.clone()
    enc = get_codec("fp32").encode(x)
    enc.parts["data"].zero_()
    assert torch.equal(x, keep)


def test_fp32_refuses_what_every_codec_refuses():
    c = get_codec("fp32")
    with pytest.raises(ValueError, match="rank"):
        c.encode(torch.zeros(8))
    with pytest.raises(ValueError, match="dtype"):
        c.encode(torch.zeros(2, 2, dtype=torch.int32))
    other = get_codec("fp16").encode(torch.zeros(2, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="enc.codec must be 'fp32'"):
        c.decode(other)


def test_a_float32_store_with_fp32_tiers_returns_every_evicted_block_exactly(tmp_path):
    from kvtier.config import KVTierConfig
    from kvtier.store import KVStore

    cfg = KVTierConfig(codec="fp32", block_tokens=16, device_tokens=32, host_bytes=64 << 10,
                       disk_path=str(tmp_path / "l3"), disk_segment_bytes=1 << 20, disk_bytes=8 << 20)
    st = KVStore(cfg, num_layers=2, kv_heads=3, head_dim=64, dtype=torch.float32, device="cpu")
    try:
        seq = st.add_sequence()
        k = torch.randn(3, 300, 64)  # [kv_heads, tokens, head_dim]: most of it in L2 and L3
        for layer in range(2):
            st.append(seq, layer, k, k + layer)
        st.end_step()
        s = st.stats()
        assert s["blocks"]["l2"] > 0 and s["blocks"]["l3"] > 0
        for layer in range(2):
            gk, gv = st.gather(seq, layer)
            assert torch.equal(gk, k) and torch.equal(gv, k + layer)
    finally:
        st.close()
