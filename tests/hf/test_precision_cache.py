"""precision="importance" through TieredCache on the real model: dense attention observes every
step, evicted blocks carry the codec their mass ranks them to, cold ones have backups in L3."""
from __future__ import annotations

import torch

import kvtier
from kvtier.config import KVTierConfig
from kvtier.models import text_ids
from kvtier.store.blockrecord import unpack_block


def test_dense_importance_mixes_codecs_and_stays_close(model_bf16, tokenizer, tmp_path, restore_attention):
    ids = text_ids(tokenizer, 200, offset=5000)
    cfg = KVTierConfig(block_tokens=32, device_tokens=96, host_bytes=8 << 20, disk_path=str(tmp_path / "l3"),
                       disk_segment_bytes=1 << 20, codec="int4", policy="h2o", precision="importance",
                       heavy_fraction=0.2, cold_fraction=0.4, write_through=False)
    restore_attention(model_bf16)
    with torch.inference_mode():
        with kvtier.attach(model_bf16, cfg) as cache:
            for i in range(0, 192, 64):  # chunked prefill: each chunk's statistics precede the next eviction
                model_bf16(input_ids=ids[:, i:i + 64], cache=cache, use_cache=True)
            got = [model_bf16(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits[0, -1].float()
                   for i in range(192, 198)]
            store = cache.store
            store.check_invariants()
            st = store.stats()["precision"]
            codecs = {}
            for t in store.residency.tables[cache.seqs[0]]:
                for e in t.entries[:-1]:
                    if e.l2:
                        ek, _ = unpack_block(store.offload.l2.get(e.rec.key))
                        codecs[ek.codec] = codecs.get(ek.codec, 0) + 1
                        assert ek.codec == e.rec.l2_codec
                    assert e.seen > 0  # dense steps observed every sealed block
        ref_out = model_bf16(input_ids=ids[:, :198], use_cache=False).logits[0, 192:198].float()
    assert set(codecs) == {"int8", "int4", "int2"}, codecs
    assert st["encoded"]["int2"] == st["backups"] > 0 and st["backups_failed"] == 0
    # int4-class quantization of most of the context: the next-token choice barely moves
    agree = (torch.stack(got).argmax(-1) == ref_out.argmax(-1)).float().mean().item()
    assert agree >= 0.75, agree
