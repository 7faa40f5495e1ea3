"""One shared prefill per sample: each configuration built from it equals its own prefill, and
the same command with the same seed gives the same accuracy figures."""
from __future__ import annotations

import json

import pytest
import torch

from kvtier.eval.caches import CacheSpec, Run, prefill, snapkv_keep
from kvtier.models import text_ids


def _decode(model, cache, ids, start, after=lambda: None):
    out = []
    for t in range(ids.shape[1]):
        o = model(input_ids=ids[:, t:t + 1], position_ids=torch.tensor([[start + t]]), cache=cache, use_cache=True)
        after()
        out.append(o.logits[0, -1].float())
    return torch.stack(out)


@pytest.mark.parametrize("spec", [
    CacheSpec("kv", "kvtier", {"codec": "int4", "attention": "sparse", "device_tokens": 64, "block_tokens": 16,
                               "host_bytes": 1 << 20, "policy": "lru", "write_through": False}),
    CacheSpec("kvd", "kvtier", {"codec": "int4", "attention": "dense", "device_tokens": 64, "block_tokens": 16,
                                "host_bytes": 1 << 20, "policy": "lru", "write_through": False}),
    CacheSpec("q", "quanto", {"nbits": 4}),
])
@torch.inference_mode()
def test_built_from_shared_prefill_equals_a_direct_prefill(model_bf16, tokenizer, tmp_path, spec):
    ids = text_ids(tokenizer, 308)
    ctx, cont = ids[:, :300], ids[:, 300:]
    pre = prefill(model_bf16, ctx[0])
    wrapped = Run(spec, model_bf16, pre, 300, tmp_path)
    direct = Run(spec, model_bf16, None, 300, tmp_path) if spec.kind == "kvtier" else None
    try:
        if direct is None:
            from transformers import QuantizedCache

            cache = QuantizedCache("quanto", model_bf16.config, nbits=4)
            first = model_bf16(input_ids=ctx, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()
        else:
            cache = direct.cache
            first = model_bf16(input_ids=ctx, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()
        assert torch.equal(first, pre.logits)
        # settled before and after each step, as kvtier eval does: until a block's swap-out is
        # done a read still finds its full-precision copy, so which blocks a step reads encoded
        # would otherwise depend on the worker thread's timing (a loaded machine parts them)
        wrapped.settle()
        if direct is not None:
            direct.settle()
        a = _decode(model_bf16, wrapped.cache, cont, 300, after=wrapped.settle)
        b = _decode(model_bf16, cache, cont, 300, after=direct.settle if direct is not None else lambda: None)
        assert torch.equal(a, b)
        if spec.kind == "kvtier":
            sa, sb = wrapped.cache.stats(), cache.stats()
            assert sa["blocks"] == sb["blocks"] and sa["bytes"] == sb["bytes"]
    finally:
        wrapped.close()
        if direct is not None:
            direct.close()


def test_snapkv_keeps_the_window_and_the_most_attended():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 40, 8)
    q = torch.randn(1, 4, 4, 8)
    keys[0, :, 5] = q[0, :2].mean(1) * 20   # token 5: what the window's queries match
    keep = snapkv_keep(keys, q, budget=10, window=4, kernel=1)
    assert keep.shape == (2, 10)
    for h in range(2):
        assert set(range(36, 40)) <= set(keep[h].tolist())
    assert 5 in keep[0].tolist()


@pytest.mark.slow
def test_same_seed_same_accuracy(tmp_path):
    from kvtier.commands.cli import main

    argv = ["eval", "--contexts", "256", "--continuation", "6", "--windows", "2", "--no-probe",
            "--only", "quanto int4,kvtier int4 sparse L1=25%", "--threads", "1"]
    docs = []
    for i in range(2):
        assert main(argv + ["--out", str(tmp_path / str(i))]) == 0
        docs.append(json.loads((tmp_path / str(i) / "eval.json").read_text()))
    acc = [[(r["config"], r["accuracy"]) for r in d["results"]] for d in docs]
    assert acc[0] == acc[1]
    assert all("ci" in a for _, a in acc[0])


@torch.inference_mode()
def test_kept_prefill_is_read_back_exactly_and_a_broken_one_recomputed(model_bf16, tokenizer, tmp_path):
    ids = text_ids(tokenizer, 48)[0]
    first = prefill(model_bf16, ids, 8, cache_dir=tmp_path)
    files = list(tmp_path.glob("prefill-48-*.safetensors"))
    assert len(files) == 1 and (files[0].stat().st_mode & 0o077) == 0   # owner-only
    again = prefill(model_bf16, ids, 8, cache_dir=tmp_path)
    assert again.seconds == first.seconds                               # read back, not recomputed
    assert torch.equal(again.logits, first.logits)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(again.kv, first.kv))
    assert all(torch.equal(a, b) for a, b in zip(again.queries, first.queries))
    assert again.queries[0].shape[-2] >= 32                              # kept with snapkv's default window
    files[0].write_bytes(b"not a safetensors file")
    fresh = prefill(model_bf16, ids, 8, cache_dir=tmp_path)
    assert torch.equal(fresh.logits, first.logits) and fresh.seconds != first.seconds


@torch.inference_mode()
def test_a_slow_swap_out_worker_does_not_change_the_figures(model_bf16, tokenizer, tmp_path, monkeypatch):
    """Each step reads every block evicted before it as encoded, however late the swap-out
    worker gets to it: the figures do not depend on thread timing."""
    import time

    from kvtier.eval.data import Window
    from kvtier.eval.runner import run_all
    from kvtier.store.evictor import Evictor

    ids = text_ids(tokenizer, 120)[0]
    w = Window("text", ids[:96].clone(), ids[96:].clone())
    spec = CacheSpec("kv", "kvtier", {"codec": "int2", "attention": "dense", "device_tokens": 32, "block_tokens": 16,
                                      "host_bytes": 1 << 20, "policy": "lru", "write_through": False})
    fast = run_all(model_bf16, [spec], w, tmp_path)[0]
    batch = Evictor._swap_out_batch

    def late(self, items):
        time.sleep(0.05)
        return batch(self, items)

    monkeypatch.setattr(Evictor, "_swap_out_batch", late)
    slow = run_all(model_bf16, [spec], w, tmp_path)[0]
    assert fast.stats["swap_out_blocks"] > 0
    assert torch.equal(fast.logp, slow.logp)
