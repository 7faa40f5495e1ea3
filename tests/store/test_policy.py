"""Exact eviction orders of each policy on constructed block tables."""
import torch

from kvtier.store.policy import make_policy
from kvtier.store.table import BlockEntry, BlockTable


def table(n_blocks: int, **attrs) -> BlockTable:
    """n_blocks entries (the last one open), all resident; attrs: name -> list per block."""
    t = BlockTable(0, 0, 1, 4, torch.device("cpu"), torch.float32)
    for i in range(n_blocks):
        e = BlockEntry(i, f"0/0/{i}")
        for name, vals in attrs.items():
            setattr(e, name, vals[i])
        t.entries.append(e)
    # taken in reverse: the policy's order must not depend on the order blocks became resident
    for e in reversed(t.entries):
        t.take_slot(e, e.idx)
    return t


def test_lru_order_by_last_use_then_age():
    t = table(6, last_used=[5, 1, 3, 1, 0, 9])
    p = make_policy("lru", sink_blocks=1, window_blocks=1)  # lru protects nothing
    assert p.victims(t, 5) == [4, 1, 3, 2, 0]  # open block 5 never offered
    assert p.victims(t, 2) == [4, 1]


def test_sink_window_evicts_middle_oldest_first():
    t = table(9)  # sealed 0..7, open 8
    p = make_policy("sink-window", sink_blocks=1, window_blocks=2)
    assert p.victims(t, 3) == [1, 2, 3]
    assert p.victims(t, 5) == [1, 2, 3, 4, 5]
    # only when nothing else is left do protected blocks go, least recently used first
    t.entries[0].last_used, t.entries[6].last_used, t.entries[7].last_used = 3, 1, 2
    assert p.victims(t, 8) == [1, 2, 3, 4, 5]  # watermark eviction never takes protected blocks
    assert p.victims(t, 8, force=True) == [1, 2, 3, 4, 5, 6, 7, 0]


def test_h2o_keeps_most_mass():
    mass = [9.0, 0.5, 7.0, 0.1, 3.0, 0.5, 2.0, 8.0, 0.0]
    t = table(9, mass=mass)
    p = make_policy("h2o", sink_blocks=0, window_blocks=1)  # block 7 is the window
    assert p.victims(t, 4) == [3, 1, 5, 6]  # ties (0.5) leave oldest first
    kept = set(range(8)) - set(p.victims(t, 4))
    assert kept == {0, 2, 4, 7}


def test_snapkv_orders_by_importance_not_mass():
    t = table(6, importance=[1.0, 0.2, 0.9, 0.3, 0.0, 0.0], mass=[0, 9, 9, 9, 9, 0])
    p = make_policy("snapkv", sink_blocks=1, window_blocks=1)
    assert p.victims(t, 2) == [1, 3]


def test_pending_excluded_and_clean_only():
    t = table(6)
    t.entries[1].pending = True
    t.entries[3].l2 = True
    p = make_policy("sink-window", sink_blocks=0, window_blocks=0)
    assert p.victims(t, 10) == [0, 2, 3, 4]
    assert p.victims(t, 10, only_clean=True) == [3]
    assert p.victims(t, 10, exclude={0, 2}) == [3, 4]
