"""``KVStore.stats()``: the counters, the tables' footprint and the tiers' own numbers as one
plain, JSON-serialisable dict."""
from __future__ import annotations

from .copies import add_below
from .stats import ratio


def store_stats(store) -> dict:
    lay = store.layout
    c = store.counters.snapshot()
    fp = _footprint(store.residency)
    lat = store.counters.latency_summaries()
    offload = store.offload
    bt = lay.block_tokens
    below = fp["below"]
    # digests live on the L1 device next to the pool: they are part of L1's footprint
    nbytes = {"l1": fp["resident"] * lay.slot_bytes + fp["digest_bytes"], "l2": below["bytes_l2"],
              "l3": below["bytes_l3"]}
    tok = {"l1": fp["l1_tokens"], "l2": below["copies_l2"] * bt, "l3": below["copies_l3"] * bt}
    return {
        "tokens": fp["tokens"],
        "sequences": fp["sequences"],
        "blocks": fp["home"],
        "copies": {"l1": fp["resident"], "l2": below["copies_l2"], "l3": below["copies_l3"]},
        "bytes": nbytes,
        "digest_bytes": fp["digest_bytes"],
        "digest_reserved_bytes": fp["digest_reserved"],
        "bytes_per_token": {k: ratio(nbytes[k], tok[k]) for k in nbytes},
        "tier_used_bytes": {"l1": store.l1.used_bytes, "l2": offload.l2.used_bytes,
                            "l3": offload.l3.used_bytes if offload.l3 is not None else 0},
        "hits": {"l1": c["hits_l1"], "l2": c["hits_l2"], "l3": c["hits_l3"], "prefetch": c["pf_used"]},
        "misses": {"l1": c["misses_l1"], "l2": c["misses_l2"], "l3": c["misses_l3"]},
        "swap_in_bytes": {"l2": c["swap_in_l2_bytes"], "l3": c["swap_in_l3_bytes"]},
        "swap_out_bytes": {"l2": c["swap_out_l2_bytes"], "l3": c["swap_out_l3_bytes"]},
        "swap_in_blocks": c["swap_in_blocks"],
        "swap_out_blocks": c["swap_out_blocks"],
        "evictions": {"clean": c["evicted_clean"], "dirty": c["evicted_dirty"],
                      "failed": c["evict_failed"], "sync": c["sync_evictions"],
                      # the codec or a tier put raised: the block stays in L1 (``held``)
                      "swap_out_errors": c["swap_out_failed"], "held": fp["held"]},
        "scratch_uses": c["scratch_uses"],
        # the L1 pool: live sequences it holds without growing, and how often it grew for more
        "l1_pool": {"sequences": store.residency.groups, "capacity_bytes": store.l1.capacity_bytes,
                    "growths": c["l1_growths"]},
        # gather_view: steps served as views of L1, steps that fell back to a copy, and block
        # copies made to keep each table's attended run contiguous
        "gather": {"views": c["gather_views"], "copies": c["gather_copies"],
                   "moved_blocks": c["region_moves"]},
        "swap_in_latency": lat["swap_in"],
        "swap_out_latency": lat["swap_out"],
        "step_time": lat["step"],
        # the same steps split by whether any block was swapped in during them
        "step_time_swapped": lat["step_swapped"],
        "step_time_unswapped": lat["step_unswapped"],
        "prefetch": _prefetch_stats(store, c),
        "compression": _compression_stats(store, c),
        "precision": _precision_stats(store, c),
        "config": {"order": store.cfg.order, "policy": store.cfg.policy, "attention": store.cfg.attention,
                   "block_tokens": bt, "hot_blocks": lay.device_blocks, "budget_tokens": lay.budget_tokens},
        "fingerprint": store.fingerprint,
        "prefix": _prefix_stats(fp["refs"], c),
        "remote": _remote_stats(offload.l4, c),
        # the L3 tier's own numbers: records, capacity, evictions, admission, bytes written,
        # compactions, corrupt records (None without L3)
        "disk": offload.l3.stats() if offload.l3 is not None else None,
        # stored blocks whose identity did not match this store's: read as misses
        "identity_refusals": c["identity_refusals"],
    }


def sequences_stats(store, seqs: list[int]) -> dict:
    """What the live sequences ``seqs`` (one conversation's rows) hold: ``tokens`` (each token
    once, not once per layer), blocks (one layer's block each) and bytes per tier, and
    ``bytes_per_token_all_layers``: a tier's bytes per token it holds, summed over the layers
    (the unit of the README's tables). A block shared with other sequences (a common prefix) is
    counted in full here and in theirs."""
    lay = store.layout
    fp = _footprint_of(store.residency, seqs)
    nbytes = {"l1": fp["resident"] * lay.slot_bytes + fp["digest_bytes"], "l2": fp["bytes_l2"],
              "l3": fp["bytes_l3"]}
    # tokens held per tier, counted once per (token, layer)
    tok = {"l1": fp["l1_tokens"], "l2": fp["copies_l2"] * lay.block_tokens,
           "l3": fp["copies_l3"] * lay.block_tokens}
    return {
        "tokens": fp["tokens"] // lay.num_layers,
        "blocks": {"l1": fp["resident"], "l2": fp["copies_l2"], "l3": fp["copies_l3"]},
        "bytes": nbytes,
        "digest_bytes": fp["digest_bytes"],
        "bytes_per_token_all_layers": {k: ratio(nbytes[k] * lay.num_layers, tok[k]) for k in nbytes},
    }


def store_summary(st: dict, num_layers: int) -> dict:
    """The whole store's figures of ``st`` (a :func:`store_stats` dict) in the README's units:
    tokens each counted once, bytes per token summed over the layers, hits as shares of the
    block reads (one block of one layer that a step attends)."""
    hits, misses = st["hits"], st["misses"]
    reads = hits["l1"] + misses["l1"]
    remote = st["remote"]
    below = {"l2": hits["l2"], "l3": hits["l3"], "l4": remote["hits"] if remote else 0}
    return {
        "layers": num_layers,
        "sequences": st["sequences"],
        "tokens": st["tokens"] // num_layers,
        "bytes": dict(st["bytes"]),
        "bytes_per_token_all_layers": {k: None if v is None else v * num_layers
                                       for k, v in st["bytes_per_token"].items()},
        "block_reads": reads,
        "l1_hit_share": ratio(hits["l1"], reads),
        # blocks read from each lower tier (swap-ins and prefetches) per block read
        "read_share": {k: ratio(v, reads) for k, v in below.items()},
    }


def _footprint(residency) -> dict:
    """What the tables hold: tokens, resident blocks and the tokens they hold, digest bytes,
    blocks per home tier, copies and bytes below L1, references per content record."""
    bt = residency.layout.block_tokens
    out = dict(tokens=0, resident=0, l1_tokens=0, digest_bytes=0, digest_reserved=0, held=0)
    with residency.lock:
        for tables in residency.tables.values():
            for t in tables:
                _add_table(out, t, bt)
                out["held"] += sum(1 for e in t.slotted.values() if e.held)
                if t.digest is not None:
                    out["digest_reserved"] += t.digest_reserved_bytes()
        copies = residency.copies
        out.update(sequences=len(residency.tables), home=dict(residency.home), below=dict(copies.below),
                   refs=[len(r.entries) for r in copies.values() if r.content])
    return out


def _footprint_of(residency, seqs: list[int]) -> dict:
    """What the tables of live sequences ``seqs`` hold: tokens (x layers), resident blocks and
    the tokens they hold, digest bytes, and the copies below L1 with their bytes. A copy shared
    with other sequences is counted in full, once."""
    bt = residency.layout.block_tokens
    out = dict(tokens=0, resident=0, l1_tokens=0, digest_bytes=0,
               copies_l2=0, bytes_l2=0, copies_l3=0, bytes_l3=0)
    seen: set[int] = set()
    with residency.lock:
        for seq in seqs:
            for t in residency.tables.get(seq, ()):
                _add_table(out, t, bt)
                for e in t.entries:
                    rec = e.rec
                    if id(rec) in seen:
                        continue
                    seen.add(id(rec))
                    add_below(out, rec)
    return out


def _add_table(out: dict, t, bt: int) -> None:
    """Add table ``t``'s tokens, resident blocks, the tokens they hold and its digest bytes to
    ``out`` (state lock held)."""
    out["tokens"] += t.length
    out["resident"] += t.resident
    if t.entries:  # the open block holds length - sealed tokens, not block_tokens
        out["l1_tokens"] += t.resident * bt - (len(t.entries) * bt - t.length)
    if t.digest is not None:
        out["digest_bytes"] += t.n_sealed * t.digest_row_bytes()


def _prefetch_stats(store, c: dict) -> dict:
    on = store.prefetch
    return {
        "enabled": on,
        "issued": c["pf_issued"], "used": c["pf_used"], "wasted": c["pf_wasted"],
        "precision": ratio(c["pf_used"], c["pf_used"] + c["pf_wasted"]),
        # None while off: no prefetch to have covered the misses (not a measured 0)
        "coverage": ratio(c["pf_used"], c["misses_l1"]) if on else None,
        "by_source": {src: dict(v, precision=ratio(v["used"], v["used"] + v["wasted"]))
                      for src, v in store.prefetcher.by_source().items()},
    }


def _compression_stats(store, c: dict) -> dict:
    lay = store.layout
    stage = store.io.stage.algorithm
    stage_ratio = ratio(c["stage_in"], c["stage_out"])
    return {
        "host_codec": lay.host_codec, "disk_codec": lay.disk_codec,
        "l2_ratio": ratio(c["raw_l2"], c["enc_l2"]),
        "l3_ratio": ratio(c["raw_l3"], c["enc_l3"]) if lay.transcode else ratio(c["raw_l2"], c["enc_l2"]),
        # the lossless stage as achieved (flag bytes included; records kept raw count 1.0)
        "byte_stage": stage, "byte_stage_l2": lay.l2_staged,
        "byte_stage_ratio": stage_ratio,
        # the same figure under its first name, kept for readers of lz4-only stats
        "lz4_ratio": stage_ratio if stage == "lz4" else None,
    }


def _precision_stats(store, c: dict) -> dict | None:
    """precision="importance": blocks encoded for L2 per codec, base-codec backups put to L3
    (and refused); recalls that marked a low copy (``marked``), the low copies replaced by
    their backup then (``upgrades``, the backups' ``upgrade_bytes`` read from L3 for it) and
    the backups that could not be read (``upgrades_failed``: the low copy stayed); resident
    decodes of a low copy freed by a mark so that their next read swaps in the backup
    (``refetched``)."""
    plan = store.layout.precision
    if plan is None:
        return None
    return {"encoded": {name: c[f"precision_{name}"] for name in plan.codecs},
            "backups": c["precision_backups"], "backups_failed": c["precision_backup_failed"],
            "marked": c["precision_marked"], "upgrades": c["precision_upgrades"],
            "upgrade_bytes": c["precision_upgrade_bytes"], "upgrades_failed": c["precision_upgrade_failed"],
            "refetched": c["precision_refetched"]}


def _prefix_stats(refs: list[int], c: dict) -> dict:
    shared = [n for n in refs if n > 1]
    return {
        "lookups": c["prefix_lookups"], "lookup_tokens": c["prefix_lookup_tokens"],
        "hit_tokens": c["prefix_hit_tokens"], "prefill_tokens_saved": c["prefill_tokens_saved"],
        "content_blocks": len(refs), "shared_blocks": len(shared), "shared_refs": sum(shared),
        "max_refs": max(refs, default=0), "dedup_seals": c["dedup_seals"],
        "adopted_l3": c["adopted_l3"], "orphans_deleted": c["orphans_deleted"], "l3_disk_full": c["l3_disk_full"],
        "published_l3": {"blocks": c["pub_l3_blocks"], "bytes": c["pub_l3_bytes"],
                         "failed": c["pub_l3_failed"], "not_admitted": c["pub_l3_not_admitted"]},
        "publish_encode_failed": c["pub_encode_failed"],
    }


def _remote_stats(l4, c: dict) -> dict | None:
    if l4 is None:
        return None
    return {
        "hits": c["hits_l4"], "misses": c["misses_l4"], "swap_in_bytes": c["swap_in_l4_bytes"],
        "published_blocks": c["pub_l4_blocks"], "published_bytes": c["pub_l4_bytes"],
        "publish_failed": c["pub_l4_failed"],
        "tier": l4.stats(),  # puts, gets, bytes, errors, latency p50/p99 ms, connected
    }
