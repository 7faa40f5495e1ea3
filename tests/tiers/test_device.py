"""DeviceTier specifics: the preallocated pool, tensor slots, fenced slot reuse."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch

from kvtier.tiers import DeviceTier

SHAPE = (2, 3, 4, 8)  # [k/v, kv_heads, block_tokens, head_dim]


def test_pool_is_one_preallocated_tensor_and_slots_alias_it():
    t = DeviceTier(SHAPE, num_slots=4, dtype=torch.float16)
    assert t.pool.shape == (4, *SHAPE) and t.pool.dtype == torch.float16
    ptr = t.pool.data_ptr()
    x = torch.randn(SHAPE, dtype=torch.float32)
    assert t.put("a", x)
    slot = t.slot_of("a")
    view = t.get_tensor("a")
    assert view.data_ptr() == t.pool[slot].data_ptr()  # aliases the pool, no copy
    assert torch.equal(view, x.to(torch.float16))  # cast to the pool dtype
    for i in range(50):  # steady state: no new allocation, same pool
        t.delete("a")
        t.put("a", x)
    assert t.pool.data_ptr() == ptr and t.slot_bytes == 2 * 3 * 4 * 8 * 2


def test_store_can_index_many_slots_in_one_op():
    t = DeviceTier(SHAPE, num_slots=8, dtype=torch.float32)
    xs = {f"b{i}": torch.full(SHAPE, float(i)) for i in range(5)}
    for k, v in xs.items():
        t.put(k, v)
    idx = torch.tensor([t.slot_of(k) for k in xs])
    gathered = t.pool[idx]  # [n, *SHAPE]
    assert torch.equal(gathered, torch.stack(list(xs.values())))


def test_tensor_shape_checked():
    t = DeviceTier(SHAPE, num_slots=2)
    with pytest.raises(ValueError, match="value"):
        t.put("a", torch.zeros(2, 3, 4, 7))


def test_bad_constructor_args():
    with pytest.raises(ValueError, match="slot_shape"):
        DeviceTier((), 2)
    with pytest.raises(ValueError, match="slot_shape"):
        DeviceTier((0, 4), 2)
    with pytest.raises(ValueError, match="num_slots"):
        DeviceTier((4,), 0)
    with pytest.raises(ValueError, match="dtype"):
        DeviceTier((4,), 2, dtype="float16")


@pytest.mark.parametrize("make_fence,complete", [
    (threading.Event, lambda f: f.set()),
    (Future, lambda f: f.set_result(None)),
])
def test_fenced_slot_not_reused_until_copy_completes(make_fence, complete):
    t = DeviceTier((16,), num_slots=2, dtype=torch.uint8)
    assert t.put("a", b"a" * 16) and t.put("b", b"b" * 16)
    slot_a = t.slot_of("a")
    fence = make_fence()
    assert t.delete("a", fence=fence)
    assert t.free_slots == 0 and t.pending_slots == 1
    assert t.put("c", b"c" * 16) is False  # the copy out of a's slot is still running
    assert bytes(t.pool[slot_a]) == b"a" * 16  # and its bytes are untouched
    complete(fence)
    assert t.free_slots == 1
    assert t.put("c", b"c" * 16) and t.slot_of("c") == slot_a


def test_mark_pending_then_overwrite_moves_to_a_new_slot():
    t = DeviceTier((8,), num_slots=3, dtype=torch.uint8)
    t.put("a", b"1" * 8)
    old = t.slot_of("a")
    ev = threading.Event()
    t.mark_pending("a", ev)  # a swap-out is reading the slot
    assert t.put("a", b"2" * 8)
    assert t.slot_of("a") != old and t.get("a") == b"2" * 8
    assert bytes(t.pool[old]) == b"1" * 8 and t.pending_slots == 1
    ev.set()
    assert t.free_slots == 2


def test_overwrite_without_pending_copy_is_in_place():
    t = DeviceTier((8,), num_slots=1, dtype=torch.uint8)
    t.put("a", b"1" * 8)
    assert t.put("a", b"22")  # the only slot, rewritten in place
    assert t.get("a") == b"22"


def test_bad_fence_rejected():
    t = DeviceTier((8,), num_slots=1, dtype=torch.uint8)
    t.put("a", b"1")
    with pytest.raises(ValueError, match="fence"):
        t.delete("a", fence=object())
    with pytest.raises(ValueError, match="event"):
        t.mark_pending("a", 3)
    with pytest.raises(ValueError, match="not in this DeviceTier"):
        t.mark_pending("zz", threading.Event())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_with_event_fence():
    t = DeviceTier(SHAPE, num_slots=2, dtype=torch.float16, device="cuda")
    x = torch.randn(SHAPE, device="cuda")
    t.put("a", x)
    host = torch.empty(SHAPE, dtype=torch.float16, pin_memory=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        host.copy_(t.get_tensor("a"), non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(side)
    t.delete("a", fence=ev)
    ev.synchronize()
    assert t.free_slots == 2
    assert torch.equal(host.cuda(), x.half())
    assert t.put("b", b"raw bytes") and t.get("b") == b"raw bytes"


def test_uint8_tensor_of_other_shape_is_bytes():
    t = DeviceTier(SHAPE, num_slots=2, dtype=torch.float16)
    payload = torch.arange(100, dtype=torch.uint8)
    assert t.put("enc", payload)
    assert t.get("enc") == bytes(range(100))
    with pytest.raises(ValueError, match="value"):
        t.put("big", torch.zeros(t.slot_bytes + 1, dtype=torch.uint8))


def test_slot_axis_lays_slots_out_inside_the_storage():
    t = DeviceTier(SHAPE, num_slots=5, dtype=torch.float32, slot_axis=2)
    assert t.storage.shape == (2, 3, 5, 4, 8) and t.pool.shape == (5, *SHAPE)
    x = torch.randn(SHAPE)
    assert t.put("a", x)
    slot = t.slot_of("a")
    assert torch.equal(t.storage[:, :, slot], x) and torch.equal(t.get_tensor("a"), x)
    # bytes puts and gets work on the strided slots too
    assert t.put("b", b"xyz" * 5)
    assert t.get("b") == b"xyz" * 5
    out = bytearray(15)
    assert t.get_into("b", out) == 15 and bytes(out) == b"xyz" * 5
    assert t.get("a") == x.numpy().tobytes()


def test_placed_slots_are_only_handed_out_by_put_at():
    t = DeviceTier(SHAPE, num_slots=6, dtype=torch.float32, slot_axis=2, placed_slots=4)
    for i in range(2):
        assert t.put(f"g{i}", torch.zeros(SHAPE))
        assert t.slot_of(f"g{i}") >= 4
    assert not t.put("g2", torch.zeros(SHAPE))  # the general slots are full; placed ones stay out
    x, y = torch.randn(SHAPE), torch.randn(SHAPE)
    assert t.put_at("a", 1, x) and t.slot_of("a") == 1 and torch.equal(t.pool[1], x)
    assert not t.put_at("b", 1, y)  # taken
    assert t.put_at("b", 3, y)
    assert t.move("a", 0) and t.slot_of("a") == 0 and torch.equal(t.get_tensor("a"), x)
    assert not t.move("a", 3)  # taken by b
    assert t.put_at("c", 1, None)  # slot 1 was released by the move
    assert t.swap("a", "b")
    assert (t.slot_of("a"), t.slot_of("b")) == (3, 0)
    assert torch.equal(t.get_tensor("a"), x) and torch.equal(t.get_tensor("b"), y)
    assert t.delete("b") and t.put_at("d", 0, y) and len(t) == 5
    with pytest.raises(ValueError, match="slot"):
        t.put_at("e", 4, x)  # not a placed slot
    with pytest.raises(ValueError, match="already"):
        t.put_at("a", 2, x)
    with pytest.raises(ValueError, match="value"):
        t.put_at("e", 2, torch.zeros(3))


def test_delete_many_frees_placed_and_general_slots():
    t = DeviceTier(SHAPE, num_slots=4, dtype=torch.float32, slot_axis=2, placed_slots=2)
    x = torch.randn(SHAPE)
    assert t.put_at("a", 0, x) and t.put_at("b", 1, x) and t.put("g", x)
    assert t.delete_many(["a", "g", "missing"]) == [True, True, False]
    assert "a" not in t and "g" not in t and torch.equal(t.get_tensor("b"), x)
    assert t.put_at("c", 0, x)  # the placed slot is free again
    assert t.put("h", x) and t.put("i", x)  # both general slots too


def test_put_many_at_binds_all_or_none():
    t = DeviceTier(SHAPE, num_slots=6, dtype=torch.float32, slot_axis=2, placed_slots=4)
    xs = [torch.randn(SHAPE) for _ in range(3)]
    assert t.put_many_at(["a", "b"], [2, 0], xs[:2]) is None
    assert (t.slot_of("a"), t.slot_of("b")) == (2, 0)
    assert torch.equal(t.get_tensor("a"), xs[0]) and torch.equal(t.storage[:, :, 0], xs[1])
    before = t.storage.clone()
    # slot 0 is taken: the first refused is reported and nothing of the batch is bound or written
    assert t.put_many_at(["c", "d"], [1, 0], [xs[2], xs[2]]) == 1
    assert "c" not in t and "d" not in t and torch.equal(t.storage, before)
    assert t.put_many_at(["c"], [1], [xs[2]]) is None  # a batch of one
    fence = threading.Event()
    t.mark_pending("c", fence)
    t.delete("c")
    assert t.put_many_at(["d", "e"], [3, 1], xs[:2]) == 1  # slot 1 still being copied out of
    fence.set()
    assert t.put_many_at(["d", "e"], [3, 1], xs[:2]) is None and len(t) == 4
    with pytest.raises(ValueError, match="already"):
        t.put_many_at(["a"], [3], xs[:1])
    with pytest.raises(ValueError, match="slot"):
        t.put_many_at(["f"], [4], xs[:1])  # not a placed slot
    with pytest.raises(ValueError, match="distinct"):
        t.put_many_at(["f", "f"], [3, 3], xs[:2])
    with pytest.raises(ValueError, match="as many"):
        t.put_many_at(["f"], [3, 1], xs[:1])
    with pytest.raises(ValueError, match="shape"):
        t.put_many_at(["f"], [3], [torch.zeros(3)])


@pytest.mark.parametrize("slot_axis", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_put_many_at_copies_rows_of_a_batch_as_each_alone(slot_axis, dtype):
    batch = torch.randn(5, *SHAPE).to(dtype)
    picks = {
        "all rows in order": list(batch.unbind(0)),
        "some rows, out of order": [batch[3], batch[0], batch[4]],
        "rows of two tensors": [batch[0], batch.clone()[1]],
        "strided views": [batch[i].transpose(-1, -2).transpose(-1, -2)[..., :1].expand(SHAPE) for i in range(2)],
        "another dtype": [batch[i].float() for i in range(2)],
    }
    for name, values in picks.items():
        t = DeviceTier(SHAPE, num_slots=8, dtype=dtype, slot_axis=slot_axis, placed_slots=8)
        slots = [7, 2, 5, 0, 3][:len(values)]
        assert t.put_many_at([f"k{i}" for i in range(len(values))], slots, values) is None, name
        for i, (slot, v) in enumerate(zip(slots, values)):
            assert torch.equal(t.pool[slot], v.to(dtype)), name
            assert torch.equal(t.get_tensor(f"k{i}"), v.to(dtype)), name
        untouched = [x for x in range(8) if x not in slots]
        assert not t.pool[untouched].any(), name


def test_placed_slot_waits_for_its_fence():
    t = DeviceTier(SHAPE, num_slots=3, placed_slots=2)
    assert t.put_at("a", 0, torch.ones(SHAPE))
    fence = threading.Event()
    t.mark_pending("a", fence)
    t.delete("a")
    assert not t.put_at("b", 0, torch.zeros(SHAPE))  # still being copied out of
    fence.set()
    assert t.put_at("b", 0, torch.zeros(SHAPE))


def test_bad_layout_args():
    with pytest.raises(ValueError, match="slot_axis"):
        DeviceTier(SHAPE, 2, slot_axis=5)
    with pytest.raises(ValueError, match="placed_slots"):
        DeviceTier(SHAPE, 2, placed_slots=3)
