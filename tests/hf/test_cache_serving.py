"""Serving-shaped: many conversations at once on one store, one TieredCache each, interleaved
turn by turn, sharing a system prompt; every reply is what a DynamicCache per conversation gives.

fp16 model and fp16 codec (lossless); 16-token blocks, an L1 of 4 blocks per sequence and a
256 KiB L2, so most of every conversation lives in L2 and L3 between its turns.
"""
from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier.config import KVTierConfig
from tests.baselines import greedy_generate, make_baseline
from kvtier.store.store import CONTENT_KEY

SYSTEM = ("You are a patient assistant for Python programmers. Answer in one or two short sentences, "
          "name the relevant statement or built-in, and give a tiny example when it helps.")
QUESTIONS = ["What does the with statement do?", "How do I reverse a list?", "What is a generator?",
             "When should I use a tuple?", "What does yield from do?", "How do I read a file?",
             "What is a decorator?", "How do I sort a dict by value?"]
FOLLOW_UPS = ["Show one more example.", "Why is that useful?"]


def _turn(tok, text: str) -> torch.Tensor:
    s = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tok(s, return_tensors="pt", add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_eight_conversations_interleaved_on_one_store(model_fp16, tokenizer, tmp_path):
    model, tok = model_fp16, tokenizer
    system = tok(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n", return_tensors="pt",
                 add_special_tokens=False)["input_ids"]
    cfg = KVTierConfig(block_tokens=16, device_tokens=64, host_bytes=256 << 10, disk_path=str(tmp_path / "l3"),
                       disk_segment_bytes=1 << 20, codec="fp16", policy="lru", max_sequences=9)
    n_new = 5
    # the server keeps the system prompt warm in a cache of its own
    warm = kvtier.attach(model, cfg)
    with torch.inference_mode():
        model(input_ids=system, cache=warm, use_cache=True)
    store = warm.store
    store.flush()
    before = store.stats()
    caches = [kvtier.attach(model, cfg) for _ in QUESTIONS]
    assert all(c.store is store for c in caches)
    refs = [make_baseline("dynamic", model) for _ in QUESTIONS]
    ids = [torch.cat([system, _turn(tok, q)], dim=1) for q in QUESTIONS]
    ref_ids = [x.clone() for x in ids]
    shared = [c.load_prefix(x) for c, x in zip(caches, ids)]
    assert min(shared) >= 16 * (system.shape[1] // 16) > 0  # the system prompt came from the store
    for turn in range(1 + len(FOLLOW_UPS)):
        for i in range(len(QUESTIONS)):  # every conversation takes its turn before the next turn
            got = greedy_generate(model, ids[i], caches[i], n_new)
            ref = greedy_generate(model, ref_ids[i], refs[i], n_new)
            assert torch.equal(got, ref), (turn, i, tok.decode(got[0]), tok.decode(ref[0]))
            if turn < len(FOLLOW_UPS):
                nxt = _turn(tok, FOLLOW_UPS[turn])
                ids[i] = torch.cat([ids[i], got, nxt], dim=1)
                ref_ids[i] = torch.cat([ref_ids[i], ref, nxt], dim=1)
    store.flush()
    during = store.stats()
    assert during["sequences"] == 9 and during["blocks"]["l3"] > 0
    assert during["prefix"]["shared_blocks"] > 0  # the system prompt's blocks: one copy per tier
    for c in caches:
        c.close()
    store.flush()
    after = store.stats()
    # what is left is what is live: the warm cache's blocks, and nothing of the closed
    # conversations in L1 or L2; on disk only content-addressed records (their reusable
    # prefixes, reclaimed when L3 needs the room), none private to a closed sequence
    assert store.sequences() == warm.seqs and after["tokens"] == before["tokens"]
    assert after["copies"] == before["copies"] and after["bytes"]["l2"] == before["bytes"]["l2"]
    assert store.l2.used_bytes <= before["tier_used_bytes"]["l2"]
    assert all(CONTENT_KEY.fullmatch(k) for k in store.l3.keys())
    warm.close()
    assert store.closed
