"""Saved conversations checked end to end: every damaged, edited or inconsistent file is a
SavedCacheError naming the problem, found before a cache is built, without reading (or
allocating) more than the file holds; an undamaged file loads bit-exact."""
from __future__ import annotations

import json
import random
import resource
import tracemalloc

import h5py
import numpy as np
import pytest
import torch

import kvtier
from kvtier.config import KVTierConfig
from kvtier.hf.cache import TieredCache
from kvtier.hf.persist import SavedCacheError, _header_crc

FP = "test-model-0001"
LAYERS = 3
# device_tokens holds the 40 tokens: these tests are about the file, not about eviction on load
CFG = KVTierConfig(block_tokens=16, device_tokens=64, codec="int4", host_bytes=1 << 20)


class Counting(TieredCache):
    """Counts the caches built: a file that fails its checks must build none."""

    built = 0

    def __init__(self, *a, **kw):
        type(self).built += 1
        super().__init__(*a, **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved file (2 sequences x 3 layers x 40 tokens: 2 int4 blocks + an 8-token open block)
    and the K/V a clean load gives."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("persist") / "conv.h5"
    c = TieredCache(CFG, num_layers=LAYERS, kv_heads=2, head_dim=64, dtype=torch.float32, fingerprint=FP)
    for layer in range(LAYERS):
        k = torch.randn(2, 2, 40, 64)  # [batch, kv_heads, tokens, head_dim]
        c.update(k, -k, layer)
    c.save(path)
    c.close()
    ref = TieredCache.load(path, CFG, fingerprint=FP)
    kv = _kv(ref)
    ref.close()
    return path, path.read_bytes(), kv


def _kv(cache) -> list:
    return [cache.store.gather(s, layer) for s in cache.seqs for layer in range(LAYERS)]


def _load(path):
    Counting.built = 0
    return Counting.load(path, CFG, fingerprint=FP)


def _refused(path, match: str):
    with pytest.raises(SavedCacheError, match=match):
        _load(path)
    assert Counting.built == 0, "a cache was built from a file that failed its checks"


def _copy(saved, tmp_path):
    p = tmp_path / "m.h5"
    p.write_bytes(saved[1])
    return p


def _rewrite_header(f: h5py.File, **changes) -> None:
    """Edit header attributes and recompute header_crc, as a deliberate editor would."""
    for k, v in changes.items():
        f.attrs[k] = v
    h = {k: (v.decode() if isinstance(v, bytes) else v if isinstance(v, str) else int(v))
         for k, v in f.attrs.items() if k != "header_crc"}
    f.attrs["header_crc"] = _header_crc(h)


def test_the_error_is_a_public_value_error():
    assert kvtier.SavedCacheError is SavedCacheError and issubclass(SavedCacheError, ValueError)


def test_a_clean_file_loads_bit_exact(saved, tmp_path):
    c = _load(_copy(saved, tmp_path))
    try:
        assert c.get_seq_length() == 40 and len(c.seqs) == 2
        for (k, v), (rk, rv) in zip(_kv(c), saved[2]):
            assert torch.equal(k, rk) and torch.equal(v, rv)
    finally:
        c.close()


def test_flipped_bytes_in_the_open_block_are_caught(saved, tmp_path):
    p = _copy(saved, tmp_path)
    with h5py.File(p, "r+") as f:
        ds = f["seq0/layer1/open"]
        raw = ds[()]
        raw[:8] ^= 0x7F
        ds[...] = raw
    _refused(p, r"dataset 'seq0/layer1/open' fails its checksum")


def _swapped(saved, tmp_path, a: str, b: str):
    """A copy of the saved file with groups ``a`` and ``b`` exchanged (each intact, in the other's place)."""
    p = _copy(saved, tmp_path)
    with h5py.File(p, "r+") as f:
        f.move(a, "tmp")
        f.move(b, a)
        f.move("tmp", b)
    return p


def test_swapped_layers_are_caught(saved, tmp_path):
    _refused(_swapped(saved, tmp_path, "seq0/layer1", "seq0/layer2"), r"dataset 'seq0/layer1/\w+' fails its checksum")


def test_swapped_sequences_are_caught(saved, tmp_path):
    _refused(_swapped(saved, tmp_path, "seq0", "seq1"), r"dataset 'seq0/layer0/\w+' fails its checksum")


def test_metadata_edits_are_caught(saved, tmp_path):
    p = _copy(saved, tmp_path)
    with h5py.File(p, "r+") as f:
        f.attrs["tokens"] = 39
    _refused(p, "header_crc")
    p = _copy(saved, tmp_path)
    with h5py.File(p, "r+") as f:
        f.attrs["tokens"] = "forty"
    _refused(p, "attribute 'tokens' must be an int")
    p = _copy(saved, tmp_path)
    with h5py.File(p, "r+") as f:
        del f.attrs["header_crc"]
    _refused(p, "header_crc")


def test_a_4_gib_declaration_in_a_small_file_allocates_nothing(saved, tmp_path):
    p = _copy(saved, tmp_path)
    with h5py.File(p, "r+") as f:
        del f["seq0/layer0/records"]
        f.create_dataset("seq0/layer0/records", shape=(4 << 30,), dtype=np.uint8)  # declared, not stored
        ds = json.loads(f.attrs["datasets"])
        ds["seq0/layer0/records"][0] = 4 << 30
        _rewrite_header(f, datasets=json.dumps(ds, sort_keys=True))
    # numpy reports its buffers to tracemalloc: a read of the declared dataset would show as 4 GiB
    tracemalloc.start()
    try:
        _refused(p, r"dataset 'seq0/layer0/records' declares 4,294,967,296 elements; the header implies at most")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak:,} bytes allocated while refusing the file"


def test_a_consistent_header_declaring_more_than_the_config_holds_is_refused_before_reading(saved, tmp_path):
    p = _copy(saved, tmp_path)
    with h5py.File(p, "r+") as f:
        _rewrite_header(f, tokens=1 << 30)
    with pytest.raises(ValueError, match="more than this configuration's L2 and L3 hold"):
        _load(p)
    assert Counting.built == 0


def test_batch_zero_and_bad_dims_name_the_attribute(saved, tmp_path):
    for attr, value in (("batch", 0), ("kv_heads", -2), ("num_layers", 10 ** 9)):
        p = _copy(saved, tmp_path)
        with h5py.File(p, "r+") as f:
            _rewrite_header(f, **{attr: value})
        _refused(p, f"attribute '{attr}' must be in")


def test_a_missing_dataset_and_a_resized_one_are_named(saved, tmp_path):
    p = _copy(saved, tmp_path)
    with h5py.File(p, "r+") as f:
        del f["seq1/layer2/offsets"]
    _refused(p, r"dataset 'seq1/layer2/offsets' is missing")
    p = _copy(saved, tmp_path)
    with h5py.File(p, "r+") as f:
        data = f["seq0/layer0/open"][()]
        del f["seq0/layer0/open"]
        f.create_dataset("seq0/layer0/open", data=data[:-4])
    _refused(p, r"dataset 'seq0/layer0/open' declares [\d,]+ elements; the header implies")


def test_version_1_files_and_other_files_are_named(saved, tmp_path):
    p = _copy(saved, tmp_path)
    with h5py.File(p, "r+") as f:
        f.attrs["version"] = 1
    _refused(p, "format version 1; this kvtier reads version 2")
    p = tmp_path / "junk.h5"
    p.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(1000))
    _refused(p, "is not a readable HDF5 file")
    p = tmp_path / "trunc.h5"
    p.write_bytes(saved[1][: len(saved[1]) // 2])
    _refused(p, "not a readable HDF5 file|not a valid kvtier cache file")


def _mutate(rng: random.Random, path, data: bytes) -> str:
    """One random mutation of a valid file: bytes flipped, a dataset resized, an attribute changed."""
    kind = rng.choice(["flip", "flip", "resize", "attr"])
    if kind == "flip":
        b = bytearray(data)
        for _ in range(rng.choice([1, 2, 8])):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(b))
        return kind
    path.write_bytes(data)
    with h5py.File(path, "r+") as f:
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        if kind == "resize":
            name = rng.choice(names)
            old = f[name][()]
            n = max(0, len(old) + rng.choice([-9, -1, 1, 64, 1 << 20]))
            new = np.resize(old, n) if len(old) else np.zeros(n, dtype=old.dtype)
            del f[name]
            f.create_dataset(name, data=new)
        else:
            name = rng.choice(list(f.attrs))
            f.attrs[name] = rng.choice([0, -1, 1 << 40, "x", np.arange(3), f.attrs[name]])
    return kind


def test_fuzz_load_never_crashes_never_loads_wrong_and_stays_bounded(saved, tmp_path):
    rng = random.Random(18)
    p = tmp_path / "fuzz.h5"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes = {"refused": 0, "loaded": 0}
    for _ in range(300):
        _mutate(rng, p, saved[1])
        try:
            c = _load(p)
        except SavedCacheError:
            assert Counting.built == 0
            outcomes["refused"] += 1
            continue
        try:  # loaded: then it must be the conversation that was saved, bit for bit
            for (k, v), (rk, rv) in zip(_kv(c), saved[2], strict=True):
                assert torch.equal(k, rk) and torch.equal(v, rv)
        finally:
            c.close()
        outcomes["loaded"] += 1
    assert outcomes["refused"] > 200  # most mutations damage what is checked
    # peak RSS (KiB): the mutations themselves allocate a few MiB each; a load that read what a
    # damaged header declares would allocate up to GiBs
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 << 10
