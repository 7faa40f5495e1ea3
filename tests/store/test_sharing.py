"""Prefix sharing: content-addressed keys, dedup with reference counts, reuse across processes
(same L3 directory, or one redis-server) and a dead server degrading to misses."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.store import KVStore

from .conftest import check_invariants, corrupt_l3_record

L, KVH, HD, BT = 2, 2, 8, 16
PREFIX = 1024  # tokens: 64 blocks
FP = "test-model:sharing"


def make(tmp_path=None, fingerprint=FP, **kw):
    base = dict(block_tokens=BT, device_tokens=4 * BT, host_bytes=1 << 20, codec="fp16", policy="lru",
                max_sequences=4, prefetch=False)
    if tmp_path is not None:
        base.update(disk_path=str(tmp_path / "l3"), disk_segment_bytes=1 << 20, disk_bytes=256 << 20)
    base.update(kw)
    return KVStore(KVTierConfig(**base), num_layers=L, kv_heads=KVH, head_dim=HD, dtype=torch.float16,
                   fingerprint=fingerprint)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50000, n).tolist()


def kv(seed: int, n: int):
    """Per layer (k, v) [kv_heads, n, head_dim]: the KV a model would compute for these tokens."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(KVH, n, HD, generator=g).half(), torch.randn(KVH, n, HD, generator=g).half())
            for _ in range(L)]


PREFIX_IDS = tokens(1, PREFIX)
PREFIX_KV = kv(1, PREFIX)


def fill(store, ids, layers_kv, chunk=100, seq=None):
    """Prefill ``seq`` (new if None) in chunks: note the ids, append every layer, end the step."""
    seq = store.add_sequence() if seq is None else seq
    n = len(ids)
    for lo in range(0, n, chunk):
        store.note_tokens(seq, ids[lo:lo + chunk])
        for layer, (k, v) in enumerate(layers_kv):
            store.append(seq, layer, k[:, lo:lo + chunk], v[:, lo:lo + chunk])
        store.end_step()
    return seq


def cat(a, b):
    return [(torch.cat((ka, kb), 1), torch.cat((va, vb), 1)) for (ka, va), (kb, vb) in zip(a, b)]


def assert_reads(store, seq, layers_kv):
    for layer, (k, v) in enumerate(layers_kv):
        gk, gv = store.gather(seq, layer)
        assert torch.equal(gk, k) and torch.equal(gv, v), f"layer {layer} differs"


def below_l1(store) -> int:
    s = store.stats()
    return s["bytes"]["l2"] + s["bytes"]["l3"]


@pytest.mark.parametrize("how", ["append", "attach"])
def test_shared_prefix_stored_once(tmp_path, how):
    store = make(tmp_path)
    a_kv = cat(PREFIX_KV, kv(2, 200))
    a = fill(store, PREFIX_IDS + tokens(2, 200), a_kv)
    store.flush()
    one = store.stats()
    b_ids, b_kv = PREFIX_IDS + tokens(3, 150), cat(PREFIX_KV, kv(3, 150))
    if how == "append":
        b = fill(store, b_ids, b_kv)
    else:
        b = store.add_sequence()
        assert store.match_prefix(b_ids) == PREFIX
        assert store.attach_prefix(b, b_ids) == PREFIX
        fill(store, b_ids[PREFIX:], [(k[:, PREFIX:], v[:, PREFIX:]) for k, v in b_kv], seq=b)
    store.flush()
    check_invariants(store)
    two = store.stats()
    # the prefix's 64 blocks x 2 layers are shared, each stored once below L1
    n_prefix = PREFIX // BT * L
    assert two["prefix"]["shared_blocks"] == n_prefix
    assert two["prefix"]["max_refs"] == 2
    # B adds only its own blocks to each tier (150 tokens: 9 sealed, the open one stays in L1)
    own = (150 // BT) * L
    rec_bytes = max(one["bytes"]["l3"] / one["copies"]["l3"], 2 * KVH * BT * HD * 2 + 256)
    for tier in ("l2", "l3"):
        assert two["copies"][tier] - one["copies"][tier] <= own, tier
        assert two["bytes"][tier] - one["bytes"][tier] <= own * rec_bytes, tier
    assert two["copies"]["l3"] >= one["copies"]["l3"] + own - 2  # B's own blocks did get stored
    if how == "attach":
        assert two["prefix"]["prefill_tokens_saved"] == PREFIX
    assert_reads(store, a, a_kv)
    assert_reads(store, b, b_kv)

    # drop A: B still reads every token bit-exact, and the prefix is still stored once
    store.drop_sequence(a)
    check_invariants(store)
    assert store.stats()["prefix"]["shared_blocks"] == 0
    assert_reads(store, b, b_kv)
    assert store.match_prefix(PREFIX_IDS) == PREFIX
    # drop B: everything below L1 is freed
    store.drop_sequence(b)
    check_invariants(store)
    s = store.stats()
    assert s["bytes"] == {"l1": 0, "l2": 0, "l3": 0}
    assert len(store.l2) == 0 and len(store.l3) == 0 and not store.residency.copies
    assert store.match_prefix(PREFIX_IDS) == 0
    store.close()


def test_without_token_ids_the_prefix_is_stored_twice(tmp_path):
    """The control: the same two sequences without token ids store the prefix per sequence."""
    store = make(tmp_path)
    for seed, n in ((2, 200), (3, 150)):
        seq = store.add_sequence()
        for layer, (k, v) in enumerate(cat(PREFIX_KV, kv(seed, n))):
            store.append(seq, layer, k, v)
        store.end_step()
    store.flush()
    s = store.stats()
    assert s["copies"]["l2"] + s["copies"]["l3"] >= 2 * (PREFIX // BT) * L
    assert s["prefix"]["shared_blocks"] == 0
    store.close()


def test_dedup_without_disk_and_l1_only(tmp_path):
    """No L3: shared blocks are deduplicated in L2; a prefix still in another sequence's L1 is
    found and attached too."""
    store = make(device_tokens=2048)  # everything stays in L1
    a = fill(store, PREFIX_IDS, PREFIX_KV)
    assert store.match_prefix(PREFIX_IDS + [7]) == PREFIX - BT  # the last full block is still open
    b = store.add_sequence()
    assert store.attach_prefix(b, PREFIX_IDS + [7]) == PREFIX - BT
    store.note_tokens(b, PREFIX_IDS[-BT:] + [7])
    for layer, (k, v) in enumerate(PREFIX_KV):
        store.append(b, layer, k[:, -BT:], v[:, -BT:])
        store.append(b, layer, torch.zeros(KVH, 1, HD).half(), torch.zeros(KVH, 1, HD).half())
    assert store.stats()["prefix"]["shared_blocks"] == (PREFIX // BT - 1) * L
    for layer, (k, v) in enumerate(PREFIX_KV):
        gk, gv = store.gather(b, layer)
        assert torch.equal(gk[:, :PREFIX], k) and torch.equal(gv[:, :PREFIX], v)
    store.drop_sequence(a)
    store.close()


def test_tokens_noted_after_append_and_without_ids(tmp_path):
    store = make(tmp_path, device_tokens=16 * BT)
    a = store.add_sequence()
    for layer, (k, v) in enumerate(PREFIX_KV):
        store.append(a, layer, k[:, :100], v[:, :100])
    store.note_tokens(a, PREFIX_IDS[:100])  # after the append: sealed blocks still in L1 upgrade
    assert store.match_prefix(PREFIX_IDS[:100]) == 96  # 6 sealed blocks, 4 tokens open
    # a sequence without ids keeps process-local keys and works as before
    plain = store.add_sequence()
    for layer, (k, v) in enumerate(PREFIX_KV):
        store.append(plain, layer, k, v)
    store.end_step()
    store.flush()
    check_invariants(store)
    assert all(not r.content for r in store.residency.copies.values() if r.key.startswith(f"{plain}/"))
    assert_reads(store, plain, PREFIX_KV)
    store.close()


def test_bad_input():
    store = make(fingerprint="")
    seq = store.add_sequence()
    with pytest.raises(ValueError, match="fingerprint"):
        store.note_tokens(seq, [1, 2, 3])
    assert store.match_prefix(PREFIX_IDS) == 0
    store.close()
    store = make()
    seq = fill(store, PREFIX_IDS[:40], [(k[:, :40], v[:, :40]) for k, v in PREFIX_KV])
    with pytest.raises(ValueError, match="empty sequence"):
        store.attach_prefix(seq, PREFIX_IDS)
    with pytest.raises(ValueError, match="token_ids"):
        store.note_tokens(seq, [[1, 2]])
    with pytest.raises(ValueError, match="seq"):
        store.attach_prefix(99, PREFIX_IDS)
    store.close()
    with pytest.raises(ValueError, match="remote_url"):
        KVTierConfig(remote_url="http://127.0.0.1:1")


_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    from kvtier.config import KVTierConfig
    from kvtier.store import KVStore
    args = json.loads(sys.argv[1])
    cfg = KVTierConfig(**args["cfg"])
    store = KVStore(cfg, num_layers=args["L"], kv_heads=args["KVH"], head_dim=args["HD"],
                    dtype=torch.float16, fingerprint=args["fp"])
    ids = args["ids"]
    out = {"match": store.match_prefix(ids)}
    seq = store.add_sequence()
    out["attached"] = store.attach_prefix(seq, ids)
    for layer in range(args["L"]):
        k, v = store.gather(seq, layer)
        np.save(f"{args['out']}/k{layer}.npy", k.numpy(), allow_pickle=False)
        np.save(f"{args['out']}/v{layer}.npy", v.numpy(), allow_pickle=False)
    s = store.stats()
    out["saved"] = s["prefix"]["prefill_tokens_saved"]
    out["adopted_l3"] = s["prefix"]["adopted_l3"]
    out["remote_hits"] = s["remote"]["hits"] if s["remote"] else 0
    store.close()
    print(json.dumps(out))
""")


def run_child(tmp_path, cfg: dict, ids, fp=FP) -> dict:
    out = tmp_path / "child"
    out.mkdir(exist_ok=True)
    arg = json.dumps({"cfg": cfg, "L": L, "KVH": KVH, "HD": HD, "fp": fp, "ids": ids, "out": str(out)})
    r = subprocess.run([sys.executable, "-c", _CHILD, arg], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["kv"] = [(torch.from_numpy(np.load(out / f"k{i}.npy")), torch.from_numpy(np.load(out / f"v{i}.npy")))
                 for i in range(L)] if res["attached"] else None
    return res


def base_cfg(**kw):
    d = dict(block_tokens=BT, device_tokens=4 * BT, host_bytes=1 << 20, codec="fp16", policy="lru",
             prefetch=False)
    d.update(kw)
    return d


def test_new_process_reuses_l3(tmp_path):
    disk = str(tmp_path / "l3")
    store = make(disk_path=disk, disk_segment_bytes=1 << 20)
    fill(store, PREFIX_IDS + tokens(5, 40), cat(PREFIX_KV, kv(5, 40)))
    store.close()  # no drop: the blocks stay on disk for the next process

    res = run_child(tmp_path, base_cfg(disk_path=disk, disk_segment_bytes=1 << 20), PREFIX_IDS + tokens(6, 30))
    assert res["match"] == PREFIX and res["attached"] == PREFIX and res["saved"] == PREFIX
    assert res["adopted_l3"] > 0
    for (k, v), (ck, cv) in zip(PREFIX_KV, res["kv"]):
        assert torch.equal(ck, k) and torch.equal(cv, v)

    # another model fingerprint or another codec never matches those blocks
    for fp, cfg in (("other-model", base_cfg(disk_path=disk)), (FP, base_cfg(disk_path=disk, codec="int8")),
                    (FP, base_cfg(disk_path=disk, block_tokens=2 * BT, device_tokens=8 * BT))):
        res = run_child(tmp_path, cfg, PREFIX_IDS, fp=fp)
        assert res["match"] == 0 and res["attached"] == 0, (fp, cfg)
    # the mismatching stores did not wipe the content records either
    store = make(disk_path=disk)
    assert store.match_prefix(PREFIX_IDS) == PREFIX
    store.close()


@pytest.mark.parametrize("eviction", ["none", "lru"])
def test_keep_prefix_on_drop_then_reclaimed(tmp_path, eviction):
    store = make(tmp_path, disk_segment_bytes=32 << 10, disk_bytes=256 << 10, disk_eviction=eviction)
    a = fill(store, PREFIX_IDS, PREFIX_KV)
    store.drop_sequence(a, keep_prefix=True)
    # a later sequence finds it (the last full block was still open: never sealed nor stored)
    assert store.match_prefix(PREFIX_IDS) == PREFIX - BT
    b = store.add_sequence()
    assert store.attach_prefix(b, PREFIX_IDS) == PREFIX - BT
    assert store.stats()["prefix"]["adopted_l3"] == (PREFIX // BT - 2) * L  # the last one is open in b
    assert_reads(store, b, [(k[:, :PREFIX - BT], v[:, :PREFIX - BT]) for k, v in PREFIX_KV])
    store.drop_sequence(b, keep_prefix=True)
    # L3 full of unreferenced prefix records: they are reclaimed for new sequences
    for seed in (20, 21):
        ids, c_kv = tokens(seed, PREFIX), kv(seed, PREFIX)
        c = fill(store, ids, c_kv)
        store.flush()
        assert_reads(store, c, c_kv)
        store.drop_sequence(c, keep_prefix=True)
    st = store.stats()
    if eviction == "none":  # a full L3 refuses; the store then deletes every unreferenced record
        assert st["prefix"]["orphans_deleted"] > 0
    else:  # L3 evicts unreferenced records, least recently used first, before it is full
        assert st["disk"]["evictions"] > 0 and st["prefix"]["orphans_deleted"] == 0
    store.close()


def test_spill_partial_failure_accounting(tmp_path):
    """L3 full mid-batch: what landed is accounted in L3, the ring keeps every record (so they
    are in L2 too) and nothing is lost."""
    store = make(tmp_path, host_bytes=64 << 10, disk_segment_bytes=4096, disk_bytes=24 << 10,
                 device_tokens=2 * BT)
    ref_k = {layer: [] for layer in range(L)}
    seq = store.add_sequence()
    g = torch.Generator().manual_seed(3)
    with pytest.raises(RuntimeError):
        for _ in range(400):
            for layer in range(L):
                k = torch.randn(KVH, 8, HD, generator=g).half()
                store.append(seq, layer, k, k)
                ref_k[layer].append(k)
            store.end_step()
            store.flush()
    assert store.l2.stats()["spill_errors"] > 0
    with store.residency.lock:
        recs = list(store.residency.copies.values())
    assert {r.key for r in recs if r.l2} == set(store.l2.keys())
    assert {r.key for r in recs if r.l3} == set(store.l3.keys())
    s = store.stats()
    assert s["copies"]["l2"] == len(store.l2) and s["copies"]["l3"] == len(store.l3)
    assert s["bytes"]["l3"] == sum(len(store.l3.get(k)) for k in store.l3.keys())
    assert any(r.l2 and r.l3 for r in recs), "no record landed in L3 while the ring kept it"
    store.close()


# -- L4: a real redis-server ------------------------------------------------------------------------

_WRITER = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[2])
    from tests.store.test_sharing import make, fill, PREFIX_IDS, PREFIX_KV, tokens, kv, cat
    store = make(remote_url=sys.argv[1])
    fill(store, PREFIX_IDS + tokens(8, 20), cat(PREFIX_KV, kv(8, 20)))
    store.flush()
    print(json.dumps(store.stats()["remote"]["published_blocks"]))
    store.close()
""")


def test_two_processes_share_through_redis(tmp_path, redis_server):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _WRITER, redis_server.url, root], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip().splitlines()[-1]) == (PREFIX // BT + 1) * L
    # this process: no disk, nothing local; everything comes from the server
    res = run_child(tmp_path, base_cfg(remote_url=redis_server.url), PREFIX_IDS + [1, 2, 3])
    assert res["match"] == PREFIX and res["attached"] == PREFIX and res["remote_hits"] == PREFIX // BT * L
    for (k, v), (ck, cv) in zip(PREFIX_KV, res["kv"]):
        assert torch.equal(ck, k) and torch.equal(cv, v)
    res = run_child(tmp_path, base_cfg(remote_url=redis_server.url), PREFIX_IDS, fp="other-model")
    assert res["match"] == 0


def test_redis_killed_mid_run_then_restarted(redis_server):
    store = make(remote_url=redis_server.url, device_tokens=4 * BT)
    store.l4.retry_interval_s = 0.0
    a_kv = cat(PREFIX_KV, kv(9, 64))
    a = fill(store, PREFIX_IDS + tokens(9, 64), a_kv)
    store.flush()
    assert store.stats()["remote"]["published_blocks"] > 0
    redis_server.kill()
    # keep going: publishing fails quietly, local data stays intact
    b_ids, b_kv = tokens(10, 300), kv(10, 300)
    b = fill(store, b_ids, b_kv)
    store.flush()
    s = store.stats()
    assert s["remote"]["publish_failed"] > 0 and s["remote"]["tier"]["connected"] is False
    assert_reads(store, a, a_kv)
    assert_reads(store, b, b_kv)
    # a lookup of something only the dead server might hold is a miss, not an error
    other = make(remote_url=redis_server.url)
    other.l4.retry_interval_s = 0.0
    assert other.match_prefix(PREFIX_IDS) == 0
    c = other.add_sequence()
    assert other.attach_prefix(c, PREFIX_IDS) == 0
    # restarted (empty: the test server keeps nothing on disk): both reconnect, new blocks
    # publish again and the other store finds them
    redis_server.restart()
    d_ids, d_kv = tokens(11, 200), kv(11, 200)
    d = fill(store, d_ids, d_kv)
    store.flush()
    assert store.stats()["remote"]["published_blocks"] > s["remote"]["published_blocks"]
    assert store.stats()["remote"]["tier"]["connected"] is True
    assert other.match_prefix(d_ids) == 192
    assert other.attach_prefix(c, d_ids) == 192
    assert_reads(other, c, [(k[:, :192], v[:, :192]) for k, v in d_kv])
    assert other.stats()["remote"]["hits"] == 192 // BT * L
    store.drop_sequence(d)
    other.close()
    store.close()


def test_match_prefix_asks_redis_once(redis_server):
    """A prefix only the server holds is matched with one pipelined round trip, not one per key,
    and a block missing from the server ends the match there."""
    writer = make(remote_url=redis_server.url)
    fill(writer, PREFIX_IDS + tokens(12, 20), cat(PREFIX_KV, kv(12, 20)))
    writer.flush()
    reader = make(remote_url=redis_server.url)
    trips = []
    real = reader.l4._round_trip
    reader.l4._round_trip = lambda *a, **kw: trips.append(1) or real(*a, **kw)
    assert reader.match_prefix(PREFIX_IDS) == PREFIX
    assert len(trips) == 1  # PREFIX // BT * L = 128 keys
    # drop layer 1 of block 10 from the server: the match stops at that block
    _, hashes = reader.content.prefix_hashes(PREFIX_IDS)
    assert writer.l4.delete(reader.content.key(1, hashes[10]))
    assert reader.match_prefix(PREFIX_IDS) == 10 * BT
    writer.close()
    reader.close()


def test_adopting_an_l3_record_does_not_read_it(tmp_path):
    """A block sealed with a key L3 already holds adopts the record by its size from the disk
    index (Tier.value_size): no record is read or CRC-checked for it."""
    store = make(tmp_path)
    a = fill(store, PREFIX_IDS, PREFIX_KV)
    store.flush()
    store.drop_sequence(a, keep_prefix=True)
    gets = store.l3.stats()["gets"]
    b = fill(store, PREFIX_IDS, PREFIX_KV)
    assert store.stats()["prefix"]["adopted_l3"] == (PREFIX // BT - 1) * L
    assert store.l3.stats()["gets"] == gets
    assert_reads(store, b, PREFIX_KV)
    check_invariants(store)
    store.close()


def test_an_l3_prefix_is_read_a_block_per_get_many_and_a_corrupt_layer_ends_it_there(tmp_path):
    """Attaching a prefix left in L3 by an earlier store reads each block's layers with one
    ``get_many`` (no ``get``); a corrupt layer record is that layer's miss only: the prefix
    ends at its block, and the blocks before it attach bit-exact."""
    writer = make(tmp_path)
    fill(writer, PREFIX_IDS + tokens(5, 40), cat(PREFIX_KV, kv(5, 40)))
    writer.close()
    reader = make(tmp_path)
    _, hashes = reader.content.prefix_hashes(PREFIX_IDS)
    bad = reader.content.key(1, hashes[10])
    corrupt_l3_record(reader.l3, bad)
    calls = []
    get_many = reader.l3.get_many
    reader.l3.get_many = lambda keys: calls.append(list(keys)) or get_many(calls[-1])
    reader.l3.get = None  # a block-by-block L3 read fails the test
    c = reader.add_sequence()
    assert reader.attach_prefix(c, PREFIX_IDS) == 10 * BT
    blocks = [[reader.content.key(layer, h) for layer in range(L)] for h in hashes[:11]]
    assert [k for k in calls if len(k) == L and k in blocks] == blocks
    assert reader.l3.corrupt_keys == {bad}
    assert reader.stats()["prefix"]["adopted_l3"] == 9 * L  # the last block attached is still open
    assert_reads(reader, c, [(k[:, :10 * BT], v[:, :10 * BT]) for k, v in PREFIX_KV])
    reader.close()


def test_a_held_record_that_fails_to_read_is_read_once_and_ends_the_prefix_there(tmp_path):
    """attach_prefix reads a block's layers in one pass: a record this process holds, whose one
    copy below L1 (in L3) is corrupt, is that layer's miss; L3 is not asked for it again by key."""
    store = make(tmp_path, host_bytes=16 << 10)  # the ring spills most blocks to L3
    a = fill(store, PREFIX_IDS, PREFIX_KV)
    store.flush()
    _, hashes = store.content.prefix_hashes(PREFIX_IDS)

    def only_in_l3(b):
        rec = store.copies.record_of(store.content.key(1, hashes[b]))
        return rec.l3 and not rec.l2 and all(e.slot is None for e in rec.entries)

    b = next(b for b in range(4, len(hashes)) if only_in_l3(b))
    bad = store.content.key(1, hashes[b])
    corrupt_l3_record(store.l3, bad)
    asked = []
    get_many, get = store.l3.get_many, store.l3.get
    store.l3.get_many = lambda keys: asked.extend(keys) or get_many(keys)
    store.l3.get = lambda key: asked.append(key) or get(key)
    before = store.stats()["misses"]["l3"]
    c = store.add_sequence()
    assert store.attach_prefix(c, PREFIX_IDS) == b * BT
    assert asked.count(bad) == 1 and store.l3.corrupt_keys == {bad}
    assert store.stats()["misses"]["l3"] - before >= 1
    assert_reads(store, c, [(k[:, :b * BT], v[:, :b * BT]) for k, v in PREFIX_KV])
    assert_reads(store, a, PREFIX_KV[:1])  # the layer without the damage reads back whole
    store.close()
