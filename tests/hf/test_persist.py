"""Saving a conversation's cache to HDF5 and continuing it elsewhere."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
import torch

import kvtier
from kvtier.config import KVTierConfig
from kvtier.hf.cache import TieredCache
from kvtier.models import text_ids


def cfg_for(tmp_path, name, **kw) -> KVTierConfig:
    base = dict(block_tokens=16, device_tokens=64, host_bytes=128 << 10, disk_path=str(tmp_path / name),
                disk_segment_bytes=1 << 20, codec="bf16", policy="lru")
    base.update(kw)
    return KVTierConfig(**base)


def _prefill_and_save(model, tokenizer, tmp_path, **kw):
    ids = text_ids(tokenizer, 150, offset=15000)  # 9 full blocks + a 6-token open block
    path = tmp_path / "conv.h5"
    with kvtier.attach(model, cfg_for(tmp_path, "a", **kw)) as cache, torch.inference_mode():
        model(input_ids=ids[:, :-1], cache=cache, use_cache=True)
        cache.save(path)
        expected = model(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits[:, -1].float()
    return ids, path, expected


def test_save_load_continues_with_identical_logits(model_bf16, tokenizer, tmp_path):
    ids, path, expected = _prefill_and_save(model_bf16, tokenizer, tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == "kvtier-kvcache"
        assert f.attrs["codec"] == "bf16" and f.attrs["tokens"] == 149
        assert f["seq0/layer0/offsets"].shape == (10,)  # 9 full blocks as records
    cache = TieredCache.load(path, cfg_for(tmp_path, "b"), model_bf16)
    try:
        assert cache.get_seq_length() == 149
        with torch.inference_mode():
            got = model_bf16(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits[:, -1].float()
    finally:
        cache.close()
    assert torch.equal(got, expected)


def test_load_refuses_another_model(model_bf16, tokenizer, tmp_path):
    _, path, _ = _prefill_and_save(model_bf16, tokenizer, tmp_path)
    with pytest.raises(ValueError, match="fingerprint"):
        TieredCache.load(path, cfg_for(tmp_path, "b"), fingerprint="llama-0000000000000000")
    with pytest.raises(ValueError, match="model="):
        TieredCache.load(path, cfg_for(tmp_path, "b"))
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.attrs["format"] = "something-else"
    with pytest.raises(ValueError, match="not a kvtier cache"):
        TieredCache.load(other, cfg_for(tmp_path, "b"), model_bf16)


def test_lossy_codec_round_trip_stays_close(model_bf16, tokenizer, tmp_path):
    ids, path, expected = _prefill_and_save(model_bf16, tokenizer, tmp_path, codec="int8")
    with TieredCache.load(path, cfg_for(tmp_path, "b", codec="int8"), model_bf16) as cache, torch.inference_mode():
        got = model_bf16(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits[:, -1].float()
    assert got.argmax() == expected.argmax()
    assert (got - expected).abs().max() < 1.0


def test_int2_kept_key_channels_round_trip(model_bf16, tokenizer, tmp_path):
    """The saved file names the key codec's kept channels (its records carry them); it loads
    into a store configured with the same count or with none (which then stores the blocks its
    own way as they are evicted)."""
    import json

    ids, path, expected = _prefill_and_save(model_bf16, tokenizer, tmp_path, codec="int2", int2_key_outliers=4)
    with h5py.File(path, "r") as f:
        assert json.loads(f.attrs["key_codec_params"])["outliers"] == 4
    got = {}
    for n in (4, 0):
        cfg = cfg_for(tmp_path, f"b{n}", codec="int2", int2_key_outliers=n)
        with TieredCache.load(path, cfg, model_bf16) as cache, torch.inference_mode():
            got[n] = model_bf16(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits[:, -1].float()
    # the saved cache holds every block in int2 where the live one still had its L1 blocks at
    # full precision: close, not equal (the store without kept channels quantizes the loaded
    # blocks again when it evicts them: further off)
    assert got[4].argmax() == expected.argmax() and (got[4] - expected).abs().max() < 2.0
    for n in got:
        assert torch.nn.functional.cosine_similarity(got[n], expected).item() > 0.99


def test_per_role_codecs_and_key_transform_round_trip(model_bf16, tokenizer, tmp_path):
    """K4V2 with Hadamard-rotated keys: the file names each role's codec and the transform, its
    records load into a store of the same codecs and continue the conversation, and a file of one
    codec for both roles names neither."""
    import json

    k4v2 = dict(codec="int4", value_codec="int2", key_transform="hadamard")
    ids, path, expected = _prefill_and_save(model_bf16, tokenizer, tmp_path, **k4v2)
    with h5py.File(path, "r") as f:
        assert (f.attrs["codec"], f.attrs["value_codec"], "key_codec" in f.attrs) == ("int4", "int2", False)
        assert json.loads(f.attrs["key_codec_params"])["transform"] == "hadamard"
        assert "transform" not in json.loads(f.attrs["value_codec_params"])
    with TieredCache.load(path, cfg_for(tmp_path, "b", **k4v2), model_bf16) as cache, torch.inference_mode():
        got = model_bf16(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits[:, -1].float()
    assert got.argmax() == expected.argmax()
    assert torch.nn.functional.cosine_similarity(got, expected).item() > 0.99
    _, plain, _ = _prefill_and_save(model_bf16, tokenizer, tmp_path / "p", codec="int4")
    with h5py.File(plain, "r") as f:
        assert "key_codec" not in f.attrs and "value_codec" not in f.attrs


_CHILD = textwrap.dedent("""
    import sys, numpy as np, torch
    torch.set_num_threads(1)
    from kvtier.config import KVTierConfig
    from kvtier.hf.cache import TieredCache
    from kvtier.models import load_model
    path, disk, out = sys.argv[1:4]
    token = int(sys.argv[4])
    model, _ = load_model(dtype=torch.bfloat16)
    cfg = KVTierConfig(block_tokens=16, device_tokens=64, host_bytes=128 << 10, disk_path=disk,
                       disk_segment_bytes=1 << 20, codec="bf16", policy="lru")
    with TieredCache.load(path, cfg, model) as cache, torch.inference_mode():
        logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
    np.save(out, logits.float().numpy())
""")


@pytest.mark.slow
def test_save_load_in_a_second_process(model_bf16, tokenizer, tmp_path):
    ids, path, expected = _prefill_and_save(model_bf16, tokenizer, tmp_path)
    out = tmp_path / "child.npy"
    subprocess.run([sys.executable, "-c", _CHILD, str(path), str(tmp_path / "child-l3"), str(out),
                    str(int(ids[0, -1]))], check=True, timeout=300)
    got = torch.from_numpy(np.load(out, allow_pickle=False))
    assert torch.equal(got, expected[0])
