"""precision="importance": codec per evicted block by attention mass, base-codec backups in L3,
and the upgrade of a recalled low-precision block to its backup."""
import pytest
import torch

from kvtier.compress import get_codec
from kvtier.config import KVTierConfig
from kvtier.store.blockrecord import pack_block, unpack_block
from kvtier.store.precision import PrecisionPlan
from kvtier.store.sizing import check_model

from .conftest import make_store

BT, HD = 32, 32


def _store(tmp_path, **kw):
    base = dict(num_layers=1, kv_heads=2, head_dim=HD, dtype=torch.float32, block_tokens=BT,
                device_tokens=10 * BT, high_watermark=0.9, low_watermark=0.2, host_bytes=1 << 20, codec="int4", policy="h2o", precision="importance",
                heavy_fraction=0.25, cold_fraction=0.5, sink_tokens=0, window_tokens=BT)
    base.update(kw)
    return make_store(tmp_path, **base)


def _fill(st, blocks: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = st.add_sequence()
    k = torch.randn(2, blocks * BT + 1, HD, generator=g)
    v = torch.randn(2, blocks * BT + 1, HD, generator=g)
    st.append(s, 0, k, v)
    return s, k, v


def _evicted(st):
    """Eight sealed blocks observed with one mass each (heavy: 2, 7; cold: 1, 3, 4, 6), the step
    ended and its swap-outs done; the sequence, its K/V and layer 0's table."""
    s, k, v = _fill(st, 8)
    st.observe(s, 0, list(range(8)), [5.0, 0.1, 9.0, 0.2, 0.3, 7.0, 0.4, 8.0, 1.0])
    st.end_step()
    st.flush()
    return s, k, v, st.residency.tables[s][0]


def _l2_codec(st, s, b):
    e = st.residency.tables[s][0].entries[b]
    ek, _ = unpack_block(st.offload.l2.get(e.rec.key))
    return ek.codec


def test_plan_ranks_by_mid_rank():
    plan = PrecisionPlan.of(KVTierConfig(precision="importance", heavy_fraction=0.25, cold_fraction=0.5))
    ranking = sorted([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    assert [plan.choose(ranking, x) for x in ranking] == ["int2"] * 4 + ["int4"] * 2 + ["int8"] * 2
    assert plan.choose([0.0] * 8, 0.0) == "int4"  # never observed: every block ties, base codec
    assert PrecisionPlan.of(KVTierConfig()) is None


def test_codec_follows_mass_and_cold_blocks_get_backups(tmp_path):
    st = _store(tmp_path)
    s, k, v = _fill(st, 8)  # blocks 0..7 sealed, 8 open; L1 holds 10, the step ends at 2
    mass = [5.0, 0.1, 9.0, 0.2, 0.3, 7.0, 0.4, 8.0, 1.0]  # heavy: 2, 7; cold: 1, 3, 4, 6
    st.observe(s, 0, list(range(8)), mass)
    st.end_step()
    st.flush()
    t = st.residency.tables[s][0]
    out = {e.idx: _l2_codec(st, s, e.idx) for e in t.entries[:-1] if e.l2}
    assert sorted(out) == [0, 1, 2, 3, 4, 5, 6]  # h2o victims; the window block 7 stays
    want = {2: "int8", 7: "int8", 1: "int2", 3: "int2", 4: "int2", 6: "int2", 0: "int4", 5: "int4"}
    assert out == {b: want[b] for b in out}
    stats = st.stats()["precision"]
    cold = [b for b in out if want[b] == "int2"]
    assert stats["backups"] == len(cold) and stats["encoded"]["int2"] == len(cold)
    for b in cold:  # the backup is the base codec's record of the same block
        e = t.entries[b]
        assert e.l3 and e.l2
        ek, _ = unpack_block(st.io.stage.unpack(st.offload.l3.get(e.rec.key)))
        assert ek.codec == "int4"
    st.check_invariants()
    # every block reads back as its own codec decodes it
    K, V = st.gather(s, 0)
    for b in out:
        kc = get_codec(want[b], **st.cfg.codec_kwargs(want[b], "key"))  # int2 keys keep their widest channels
        ref = kc.decode(kc.encode(k[:, b * BT:(b + 1) * BT]))
        assert torch.equal(K[:, b * BT:(b + 1) * BT], ref)
    st.close()


def test_no_backups_where_no_recall_can_fire(tmp_path):
    # recall_mass=inf: a cold block is never upgraded, so no base-codec copy is written for it
    st = _store(tmp_path, recall_mass=float("inf"))
    s, k, v, t = _evicted(st)
    cold = [e for e in t.entries[:-1] if e.l2 and e.rec.l2_codec == "int2"]
    assert len(cold) == 4 and not any(e.l3 for e in cold)
    pr = st.stats()["precision"]
    assert pr["backups"] == 0 and pr["encoded"]["int2"] == 4 and st.stats()["bytes"]["l3"] == 0
    st.observe(s, 0, list(range(8)), [10.0 if e is cold[0] else 0.1 for e in t.entries[:-1]])
    assert not cold[0].rec.upgrade and st.stats()["precision"]["marked"] == 0
    K, _ = st.gather(s, 0)  # still read as its int2 copy
    b = cold[0].idx
    kc = get_codec("int2", group_size=32, axis="channel", outliers=st.cfg.int2_key_outliers)
    assert torch.equal(K[:, b * BT:(b + 1) * BT], kc.decode(kc.encode(k[:, b * BT:(b + 1) * BT])))
    st.check_invariants()
    st.close()


def test_recalled_heavy_cold_block_reads_its_backup(tmp_path):
    st = _store(tmp_path, recall_mass=2.0)
    s, k, v, t = _evicted(st)
    cold = next(e for e in t.entries[:-1] if e.l2 and e.rec.l2_codec == "int2")
    b = cold.idx
    # a recall gives it far more than the mean mass per block: marked, then read from L3 (int4)
    st.observe(s, 0, list(range(8)), [10.0 if i == b else 0.1 for i in range(8)])
    assert cold.rec.upgrade
    K, _ = st.gather(s, 0)
    kc = get_codec("int4", group_size=32, axis="channel")
    assert torch.equal(K[:, b * BT:(b + 1) * BT], kc.decode(kc.encode(k[:, b * BT:(b + 1) * BT])))
    assert not cold.rec.l2 and cold.rec.l3 and not cold.rec.upgrade
    assert st.stats()["precision"]["upgrades"] == 1
    st.check_invariants()
    st.close()


def _cold_block(st, s):
    """After the standard observation and eviction: a block stored in int2 (with its backup)."""
    st.observe(s, 0, list(range(8)), [5.0, 0.1, 9.0, 0.2, 0.3, 7.0, 0.4, 8.0, 1.0])
    st.end_step()
    st.flush()
    t = st.residency.tables[s][0]
    return next(e for e in t.entries[:-1] if e.l2 and e.rec.l2_codec == "int2")


def _decoded(codec, x):
    kc = get_codec(codec, **KVTierConfig().codec_kwargs(codec, "key"))  # as the store's keys
    return kc.decode(kc.encode(x))


# Real attention on SmolLM2: the sink takes most of an observation's mass and the recent window
# much of the rest; a recalled block stands out among the other candidates only.
_SINK, _WINDOW, _QUIET = 20.0, 6.0, 0.1


@pytest.mark.parametrize("reference, fires", [("median", True), ("mean", True), ("all-mean", False)])
def test_recall_fires_against_the_candidates_not_the_sink(tmp_path, reference, fires):
    st = _store(tmp_path, sink_tokens=BT, recall_mass=2.0, recall_reference=reference)
    s, k, _ = _fill(st, 8)
    cold = _cold_block(st, s)
    b = cold.idx
    # block 0 is the sink, 7 the window: the recalled block takes 5x the others' share, a small
    # fraction of the observation's mean mass per block (sink and window included)
    mass = [_SINK] + [_QUIET] * 6 + [_WINDOW, 1.0]
    mass[b] = 5 * _QUIET
    assert mass[b] < 2.0 * sum(mass) / len(mass)
    st.observe(s, 0, list(range(8)), mass)
    assert cold.rec.upgrade is fires
    pstats = st.stats()["precision"]
    assert pstats["marked"] == int(fires) and pstats["upgrades"] == 0  # marked; read not yet
    K, _ = st.gather(s, 0)
    want = _decoded("int4" if fires else "int2", k[:, b * BT:(b + 1) * BT])
    assert torch.equal(K[:, b * BT:(b + 1) * BT], want)
    pstats = st.stats()["precision"]
    assert pstats["upgrades"] == int(fires)
    assert pstats["upgrade_bytes"] == (cold.rec.l3_bytes if fires else 0)
    st.check_invariants()
    st.close()


def test_recall_threshold_of_the_plan():
    plan = PrecisionPlan.of(KVTierConfig(precision="importance", recall_mass=2.0))
    assert plan.recall_reference == "median"
    assert plan.recall_threshold([1.0, 3.0, 100.0], [50.0, 1.0, 3.0, 100.0]) == 6.0
    mean = PrecisionPlan.of(KVTierConfig(precision="importance", recall_mass=2.0, recall_reference="mean"))
    assert mean.recall_threshold([1.0, 3.0, 2.0], [50.0]) == 4.0
    every = PrecisionPlan.of(KVTierConfig(precision="importance", recall_mass=1.0, recall_reference="all-mean"))
    assert every.recall_threshold([], [1.0, 3.0]) == 2.0
    assert plan.recall_threshold([], [1.0]) is None  # no candidate: nothing to compare with
    never = PrecisionPlan.of(KVTierConfig(precision="importance", recall_mass=float("inf")))
    assert never.recall_threshold([1.0], [1.0]) is None


def test_a_kept_scratch_read_is_not_served_after_an_upgrade(tmp_path):
    """A sparse read swaps a cold block into a scratch slot (its region full of dirty blocks)
    and keeps its int2 decode for the next read; a recall then marks it for upgrade: the next
    read is the int4 backup's decode, not the kept int2 one."""
    st = _store(tmp_path, attention="sparse", budget_tokens=10 * BT)
    s, k, v = _fill(st, 8)
    cold = _cold_block(st, s)
    b = cold.idx
    g = torch.Generator().manual_seed(7)
    st.append(s, 0, torch.randn(2, 8 * BT, HD, generator=g), torch.randn(2, 8 * BT, HD, generator=g))
    t = st.residency.tables[s][0]
    assert t.resident == st.hot_blocks  # every slot taken by a block not yet copied below
    resident = next(e.idx for e in t.entries[:-1] if e.slot is not None)
    for _ in range(2):  # the second read is served from what the first kept
        K, _, _, order = st.gather_view(s, 0, [b, resident])
        i = order.index(b)
        assert torch.equal(K[:, i * BT:(i + 1) * BT], _decoded("int2", k[:, b * BT:(b + 1) * BT]))
    assert cold.key in st.prefetcher._kept and st.counters["swap_in_blocks"] == 1
    n = t.n_sealed
    st.observe(s, 0, list(range(n)), [10.0 if i == b else 0.1 for i in range(n)])  # recalled
    assert cold.rec.upgrade and st.stats()["precision"]["marked"] == 1
    K, _, _, order = st.gather_view(s, 0, [b, resident])
    i = order.index(b)
    assert torch.equal(K[:, i * BT:(i + 1) * BT], _decoded("int4", k[:, b * BT:(b + 1) * BT]))
    assert st.stats()["precision"]["upgrades"] == 1 and not cold.rec.l2
    assert st.stats()["prefetch"]["by_source"]["scratch"]["wasted"] >= 1  # the stale one
    K, _, _, order = st.gather_view(s, 0, [b, resident])  # kept again, now of the backup
    i = order.index(b)
    assert torch.equal(K[:, i * BT:(i + 1) * BT], _decoded("int4", k[:, b * BT:(b + 1) * BT]))
    st.check_invariants()
    st.close()


@pytest.mark.parametrize("view", [False, True])
def test_a_mark_on_a_block_in_l1_replaces_its_low_decode_at_the_next_read(tmp_path, view):
    """A recall observes a block that is in L1, swapped in from its int2 copy to be attended:
    the mark frees that decode at the block's next read, which swaps it in again from the int4
    backup, not only once it has left L1 and come back."""
    st = _store(tmp_path, **(dict(attention="sparse", budget_tokens=10 * BT) if view else {}))
    s, k, _ = _fill(st, 8)
    cold = _cold_block(st, s)
    b = cold.idx

    def read():
        if view:
            K, _, _, order = st.gather_view(s, 0, [b])
            i = order.index(b)
            return K[:, i * BT:(i + 1) * BT]
        return st.gather(s, 0)[0][:, b * BT:(b + 1) * BT]

    assert torch.equal(read(), _decoded("int2", k[:, b * BT:(b + 1) * BT]))
    assert cold.slot is not None  # resident now: the next read finds it in L1
    swapped_in = st.counters["swap_in_blocks"]
    st.observe(s, 0, list(range(8)), [10.0 if i == b else 0.1 for i in range(8)])
    assert cold.rec.upgrade
    assert torch.equal(read(), _decoded("int4", k[:, b * BT:(b + 1) * BT]))
    pstats = st.stats()["precision"]
    assert pstats["upgrades"] == 1 and pstats["refetched"] == 1
    assert not cold.rec.l2 and cold.slot is not None and st.counters["swap_in_blocks"] == swapped_in + 1
    assert torch.equal(read(), _decoded("int4", k[:, b * BT:(b + 1) * BT]))  # resident, the backup's decode
    assert st.stats()["precision"]["refetched"] == 1 and st.counters["swap_in_blocks"] == swapped_in + 1
    st.check_invariants()
    st.close()


def test_a_prefetch_read_before_the_mark_is_not_served_after_it(tmp_path):
    st = _store(tmp_path, prefetch=True)
    s, k, _ = _fill(st, 8)
    cold = _cold_block(st, s)
    b = cold.idx
    t = st.residency.tables[s][0]
    st.prefetcher.prefetch(t, [b], "temporal")
    fut = st.prefetcher._futures[cold.key]
    assert torch.equal(fut.result().data[0], _decoded("int2", k[:, b * BT:(b + 1) * BT]))  # the low copy
    st.observe(s, 0, list(range(8)), [10.0 if i == b else 0.1 for i in range(8)])
    K, _ = st.gather(s, 0)
    assert torch.equal(K[:, b * BT:(b + 1) * BT], _decoded("int4", k[:, b * BT:(b + 1) * BT]))
    assert st.stats()["precision"]["upgrades"] == 1
    st.check_invariants()
    st.close()


def test_an_unreadable_backup_leaves_the_low_copy(tmp_path):
    """The backup gone bad on disk: the upgrade is refused (counted), the mark cleared, and the
    int2 L2 copy, never dropped, is read as before."""
    st = _store(tmp_path)
    s, k, _ = _fill(st, 8)
    cold = _cold_block(st, s)
    b = cold.idx
    real_get = st.offload.l3.get
    st.offload.l3.get = lambda key: None if key == cold.rec.key else real_get(key)  # a corrupt record reads as absent
    st.observe(s, 0, list(range(8)), [10.0 if i == b else 0.1 for i in range(8)])
    K, _ = st.gather(s, 0)
    assert torch.equal(K[:, b * BT:(b + 1) * BT], _decoded("int2", k[:, b * BT:(b + 1) * BT]))
    pstats = st.stats()["precision"]
    assert pstats["upgrades"] == 0 and pstats["upgrades_failed"] == 1 and pstats["upgrade_bytes"] == 0
    assert cold.rec.l2 and cold.rec.l3 and not cold.rec.upgrade
    st.offload.l3.get = real_get
    st.check_invariants()
    st.close()


def test_without_l3_cold_blocks_stay_low():
    st = _store(None)
    s, k, v, t = _evicted(st)
    cold = [e for e in t.entries[:-1] if e.l2 and e.rec.l2_codec == "int2"]
    assert cold and st.stats()["precision"]["backups"] == 0
    st.observe(s, 0, list(range(8)), [10.0 if e.idx == cold[0].idx else 0.1 for e in t.entries[:-1]])
    st.gather(s, 0)  # no copy to upgrade to: the mark is cleared, the low copy stays
    assert cold[0].rec.l2 and not cold[0].rec.upgrade
    assert cold[0].slot is not None  # swapped in by the gather; marked again, it stays in L1
    st.observe(s, 0, list(range(8)), [10.0 if e.idx == cold[0].idx else 0.1 for e in t.entries[:-1]])
    st.gather(s, 0)
    assert cold[0].slot is not None and st.stats()["precision"]["refetched"] == 0
    st.check_invariants()
    st.close()


@pytest.mark.parametrize("kw, field", [
    (dict(precision="exact"), "precision"),
    (dict(precision="importance", policy="lru"), "policy"),
    (dict(precision="importance", codec="fp16"), "codec"),
    (dict(precision="importance", heavy_codec="int2"), "heavy_codec"),
    (dict(precision="importance", cold_codec="int8"), "cold_codec"),
    (dict(precision="importance", heavy_codec="nf4"), "heavy_codec"),
    (dict(heavy_fraction=1.5), "heavy_fraction"),
    (dict(heavy_fraction=0.6, cold_fraction=0.6), "cold_fraction"),
    (dict(recall_mass=0), "recall_mass"),
    (dict(recall_reference="max"), "recall_reference"),
    (dict(precision="importance", order="tier-then-compress"), "order"),
    (dict(precision="importance", disk_codec="int8"), "disk_codec"),
])
def test_bad_precision_fields_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        KVTierConfig(**kw)


def test_blocks_never_observed_keep_the_base_codec(tmp_path):
    st = _store(tmp_path)
    s, _, _ = _fill(st, 8)
    st.observe(s, 0, [0, 1], [5.0, 0.1])  # only two blocks were ever seen
    st.end_step()
    st.flush()
    t = st.residency.tables[s][0]
    got = {e.idx: e.rec.l2_codec for e in t.entries[:-1] if e.l2}
    assert got[1] == "int2" and all(got[b] == "int4" for b in got if b > 1), got
    st.check_invariants()
    st.close()


def test_export_gives_one_codec(tmp_path):
    st = _store(tmp_path)
    s, _, _ = _fill(st, 8)
    st.observe(s, 0, list(range(8)), [5.0, 0.1, 9.0, 0.2, 0.3, 7.0, 0.4, 8.0, 1.0])
    st.end_step()
    st.flush()
    records, _ = st.export_blocks(s, 0)
    assert len(records) == 8 and {unpack_block(r)[0].codec for r in records} == {"int4"}  # what save() writes
    st.close()


def test_observe_queries_with_the_callers_keys_equals_its_own_gather():
    a, b = _store(None), _store(None)
    sa, k, v = _fill(a, 3)
    sb, _, _ = _fill(b, 3)
    q = torch.randn(4, 2, HD, generator=torch.Generator().manual_seed(1))  # [q_heads, w, head_dim]
    a.observe_queries(sa, 0, q)
    keys, _ = b.gather(sb, 0)
    b.observe_queries(sb, 0, q, keys)
    ea, eb = a.residency.tables[sa][0].entries, b.residency.tables[sb][0].entries
    assert [e.mass for e in ea] == [e.mass for e in eb] and eb[0].seen == 1
    with pytest.raises(ValueError, match="keys must be"):
        b.observe_queries(sb, 0, q, keys[:, :-1])
    a.close()
    b.close()


def _record_params(st, e):
    ek, ev = unpack_block(st.offload.l2.get(e.rec.key))
    return ek.codec, ek.params.get("outliers", 0)


def test_a_cold_level_cheaper_than_fixed_int2_is_written_read_and_counted(tmp_path):
    # int2 keys keep 8 channels at fixed precision; the cold level here keeps none
    st = _store(tmp_path, recall_mass=float("inf"), cold_key_outliers=0)
    wide = _store(tmp_path / "wide", recall_mass=float("inf"))  # the same blocks, cold int2 with 8 channels
    assert st.cfg.codec_kwargs("int2", "key") == {"group_size": 32, "axis": "channel"}
    assert wide.cfg.codec_kwargs("int2", "key")["outliers"] == 8
    s, k, v, t = _evicted(st)
    _, _, _, tw = _evicted(wide)
    got = {e.idx: _record_params(st, e) for e in t.entries[:-1] if e.l2}
    assert {b for b, (c, _) in got.items() if c == "int2"} == {1, 3, 4, 6}
    assert all(n == 0 for c, n in got.values())  # plain int2 for the cold, int4/int8 keep none either
    assert {e.idx: _record_params(wide, e)[1] for e in tw.entries[:-1] if e.l2 and e.rec.l2_codec == "int2"} \
        == {1: 8, 3: 8, 4: 8, 6: 8}
    # each cold block reads back as plain int2 decodes it, the others as their codec does
    K, V = st.gather(s, 0)
    plain = get_codec("int2", group_size=32, axis="channel")
    for b, (c, _) in got.items():
        kc = plain if c == "int2" else get_codec(c, **st.cfg.codec_kwargs(c, "key"))
        assert torch.equal(K[:, b * BT:(b + 1) * BT], kc.decode(kc.encode(k[:, b * BT:(b + 1) * BT])))
    # stats() counts the records as written: the 4 cold records less their kept channels
    # (2 heads x 8 channels of BT float32 values and a one-byte index, and those parts' headers)
    for store, table in ((st, t), (wide, tw)):
        l2 = sum(len(store.offload.l2.get(e.rec.key)) for e in table.entries if e.l2)
        assert store.stats()["bytes"]["l2"] == l2
    x = k[:, :BT]
    kept = len(pack_block(wide.io.by_name["int2"][0].encode(x), plain.encode(x))) \
        - len(pack_block(plain.encode(x), plain.encode(x)))
    assert kept > 2 * 8 * (BT * 4 + 1)
    assert wide.stats()["bytes"]["l2"] - st.stats()["bytes"]["l2"] == 4 * kept
    assert st.stats()["precision"]["encoded"] == {"int4": 2, "int8": 1, "int2": 4}
    st.check_invariants()
    # records say how they were encoded: a store of another outlier count decodes them as written
    e = t.entries[1]
    raw = st.offload.l2.get(e.rec.key)
    ref = st.io.decode(raw, "l2", torch.device("cpu"))
    assert torch.equal(wide.io.decode(raw, "l2", torch.device("cpu")), ref)
    ek, ev = unpack_block(raw)
    general = torch.stack((plain.decode(ek), get_codec("int2", group_size=32, axis="token").decode(ev)))
    assert torch.equal(ref, general)
    wide.close()
    st.close()


def test_cold_key_outliers_follow_only_the_cold_codec():
    cfg = KVTierConfig(precision="importance", codec="int8", cold_codec="int4", cold_key_outliers=4)
    assert cfg.key_outliers("int4") == 4 and cfg.key_outliers("int8") == 0
    assert cfg.codec_kwargs("int4", "value") == {"group_size": 32, "axis": "token"}  # keys only
    # None: the cold codec keeps what it keeps at fixed precision
    assert KVTierConfig(precision="importance").key_outliers("int2") == 8
    # a fixed store ignores it (its int2 is the fixed one)
    assert KVTierConfig(codec="int2", cold_key_outliers=0).key_outliers("int2") == 8
    with pytest.raises(ValueError, match="cold_key_outliers must be <= head_dim"):
        check_model(KVTierConfig(precision="importance", cold_key_outliers=20), 1, 2, 16, torch.float16)
    # the fixed int2's count no longer applies to a cold level that sets its own
    check_model(KVTierConfig(precision="importance", int2_key_outliers=20, cold_key_outliers=4),
                1, 2, 16, torch.float16, machine=False)


@pytest.mark.parametrize("kw", [
    dict(cold_key_outliers=-1), dict(cold_key_outliers=33), dict(cold_key_outliers=True),
    dict(cold_key_outliers="0"), dict(cold_key_outliers=2.0),
    # one codec name, one encoding: the cold level cannot re-encode the base codec
    dict(precision="importance", codec="int2", cold_key_outliers=0),
])
def test_bad_cold_key_outliers_name_the_field(kw):
    with pytest.raises(ValueError, match="cold_key_outliers"):
        KVTierConfig(**kw)
