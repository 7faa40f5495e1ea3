"""kvtier.metrics on a real generate: the HTTP endpoint on a loopback port, scraped with urllib
while SmolLM2 decodes and after, parsed with prometheus_client's parser; every series equals the
store's ``stats()`` figure it reports, and the figures moved as the run did.

The run: 16-token blocks, an L1 of 8 blocks per sequence, sparse attention over 4 of them with
prefetch, a 64 KiB L2 and a 4 MiB L3 that admits on second touch, so blocks go L1 -> L2 -> L3 and
come back. Then a second cache finds the prompt's prefix stored, and a short conversation decodes
with everything in L1 (steps without a swap-in).
"""
from __future__ import annotations

import json
import math
import threading
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import kvtier
import kvtier.metrics
from kvtier.config import KVTierConfig
from kvtier.models import load_text


def _scrape(url: str) -> dict[tuple, float]:
    """{(sample name, sorted labels without store): value} of one scrape."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "store"))
            out[(s.name, labels)] = s.value
    return out


def _quantile(lat: dict, key: str) -> float:
    return lat[key] / 1e3 if lat["count"] else math.nan  # no samples: unknown, not 0


def _expected(st: dict) -> dict[tuple, float]:
    """What each series must read, from the store's stats() (written out, not derived from the
    exporter's code)."""
    d = st["disk"]
    exp = {}
    for tier in ("l1", "l2", "l3"):
        exp[("kvtier_hits_total", (("tier", tier),))] = st["hits"][tier]
        exp[("kvtier_misses_total", (("tier", tier),))] = st["misses"][tier]
        exp[("kvtier_tier_bytes", (("tier", tier),))] = st["bytes"][tier]
        exp[("kvtier_tier_used_bytes", (("tier", tier),))] = st["tier_used_bytes"][tier]
    for tier in ("l2", "l3"):
        exp[("kvtier_swap_in_bytes_total", (("tier", tier),))] = st["swap_in_bytes"][tier]
        exp[("kvtier_swap_out_bytes_total", (("tier", tier),))] = st["swap_out_bytes"][tier]
    exp[("kvtier_swap_in_blocks_total", ())] = st["swap_in_blocks"]
    exp[("kvtier_swap_out_blocks_total", ())] = st["swap_out_blocks"]
    for name, lat in (("kvtier_swap_in_seconds", st["swap_in_latency"]),
                      ("kvtier_swap_out_seconds", st["swap_out_latency"])):
        exp[(name + "_count", ())] = lat["count"]
        exp[(name + "_sum", ())] = lat["total_s"]
        exp[(name, (("quantile", "0.5"),))] = _quantile(lat, "p50_ms")
        exp[(name, (("quantile", "0.99"),))] = _quantile(lat, "p99_ms")
    for swapped, lat in (("yes", st["step_time_swapped"]), ("no", st["step_time_unswapped"])):
        exp[("kvtier_step_seconds_count", (("swapped", swapped),))] = lat["count"]
        exp[("kvtier_step_seconds_sum", (("swapped", swapped),))] = lat["total_s"]
        exp[("kvtier_step_seconds", (("quantile", "0.99"), ("swapped", swapped)))] = _quantile(lat, "p99_ms")
    exp[("kvtier_tokens", ())] = st["tokens"]
    exp[("kvtier_sequences", ())] = st["sequences"]
    exp[("kvtier_prefetch_issued_total", ())] = st["prefetch"]["issued"]
    exp[("kvtier_prefetch_used_total", ())] = st["prefetch"]["used"]
    exp[("kvtier_prefetch_wasted_total", ())] = st["prefetch"]["wasted"]
    exp[("kvtier_prefix_lookup_tokens_total", ())] = st["prefix"]["lookup_tokens"]
    exp[("kvtier_prefix_hit_tokens_total", ())] = st["prefix"]["hit_tokens"]
    exp[("kvtier_published_blocks_total", (("tier", "l3"),))] = st["prefix"]["published_l3"]["blocks"]
    exp[("kvtier_published_bytes_total", (("tier", "l3"),))] = st["prefix"]["published_l3"]["bytes"]
    exp[("kvtier_identity_refusals_total", ())] = st["identity_refusals"]
    exp[("kvtier_l3_used_bytes", ())] = d["used_bytes"]
    exp[("kvtier_l3_free_bytes", ())] = d["capacity_bytes"] - d["used_bytes"]
    exp[("kvtier_l3_capacity_bytes", ())] = d["capacity_bytes"]
    exp[("kvtier_l3_file_bytes", ())] = d["disk_bytes"]
    exp[("kvtier_l3_records", ())] = d["records"]
    exp[("kvtier_l3_written_bytes_total", ())] = (d["bytes_written"] + d["compact_bytes_written"]
                                                  + d["checkpoint_bytes_written"])
    exp[("kvtier_l3_evictions_total", ())] = d["evictions"]
    exp[("kvtier_l3_evicted_bytes_total", ())] = d["evicted_bytes"]
    exp[("kvtier_l3_offered_total", ())] = d["offered"]
    exp[("kvtier_l3_admission_refusals_total", ())] = d["admission_refused"]
    exp[("kvtier_l3_compactions_total", ())] = d["compactions"]
    exp[("kvtier_l3_crc_failures_total", (("phase", "read"),))] = d["corrupt"]
    exp[("kvtier_l3_crc_failures_total", (("phase", "scan"),))] = d["scan_corrupt"]
    exp[("kvtier_l3_disk_full_errors_total", ())] = d["disk_full_errors"]
    return exp


def _check(scraped: dict, st: dict) -> None:
    for key, want in _expected(st).items():
        assert key in scraped, f"{key} not exported"
        got = scraped[key]
        if math.isnan(want):
            assert math.isnan(got), (key, got)
            continue
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (key, got, want)


@pytest.mark.slow
def test_endpoint_scraped_during_and_after_a_generate(model_bf16, tokenizer, tmp_path):
    model = model_bf16
    cfg = KVTierConfig(block_tokens=16, device_tokens=128, host_bytes=64 << 10, disk_path=str(tmp_path / "l3"),
                       disk_bytes=4 << 20, disk_segment_bytes=256 << 10, disk_admission="second-touch",
                       codec="int8", policy="lru", attention="sparse", budget_tokens=64, prefetch=True)
    text = load_text()
    long_ids = tokenizer(text[:2000], return_tensors="pt")["input_ids"][:, :260]
    short_ids = tokenizer(text[5000:5400], return_tensors="pt")["input_ids"][:, :40]
    holder = kvtier.attach(model, cfg)  # keeps the store open between the conversations
    store = holder.store
    with kvtier.metrics.serve(0) as server:
        assert server.address == "127.0.0.1" and server.port > 0
        during: list[dict] = []
        stop = threading.Event()

        def scrape_while_running():
            while not stop.wait(0.05):
                during.append(_scrape(server.url))

        t = threading.Thread(target=scrape_while_running, daemon=True)
        t.start()
        cache = kvtier.attach(model, cfg)
        with torch.inference_mode():
            model.generate(long_ids, cache=cache, max_new_tokens=12, do_sample=False)
        stop.set()
        t.join()
        store.flush()
        _check(_scrape(server.url), store.stats())

        # counters only grow, and the scrapes taken while decoding saw them grow
        hits = ("kvtier_hits_total", (("tier", "l1"),))
        seen = [s[hits] for s in during if hits in s]
        assert len(seen) >= 2 and seen == sorted(seen) and seen[-1] > seen[0], seen

        # the prompt's prefix, found stored by another cache
        other = kvtier.attach(model, cfg)
        assert other.load_prefix(long_ids) > 0
        other.close()
        cache.close()
        # a short conversation: every block in L1, steps without a swap-in
        small = kvtier.attach(model, cfg)
        with torch.inference_mode():
            model.generate(short_ids, cache=small, max_new_tokens=4, do_sample=False)
        store.flush()
        st = store.stats()
        final = _scrape(server.url)
        _check(final, st)
        small.close()

    # every metric the exporter defines was emitted (L4: none configured here)
    names = {name for name, _ in final}
    for name, (kind, _, _) in kvtier.metrics.METRICS.items():
        want = {"counter": name + "_total", "summary": name + "_count"}.get(kind, name)
        assert want in names, name

    # and moved as the run did: blocks went to L2 and L3 and came back, prefetch ran, the
    # prefix was found, L3 admission turned blocks away, both kinds of step happened
    for key in (("kvtier_hits_total", (("tier", "l2"),)), ("kvtier_hits_total", (("tier", "l3"),)),
                ("kvtier_misses_total", (("tier", "l1"),)),
                ("kvtier_swap_in_bytes_total", (("tier", "l3"),)),
                ("kvtier_swap_out_bytes_total", (("tier", "l2"),)),
                ("kvtier_swap_out_bytes_total", (("tier", "l3"),)),
                ("kvtier_swap_in_seconds_sum", ()), ("kvtier_swap_out_seconds_sum", ()),
                ("kvtier_step_seconds_count", (("swapped", "yes"),)),
                ("kvtier_step_seconds_count", (("swapped", "no"),)),
                ("kvtier_prefetch_issued_total", ()), ("kvtier_prefetch_used_total", ()),
                ("kvtier_prefix_hit_tokens_total", ()), ("kvtier_published_bytes_total", (("tier", "l3"),)),
                ("kvtier_l3_used_bytes", ()), ("kvtier_l3_admission_refusals_total", ())):
        assert final[key] > 0, (key, json.dumps(st, default=str)[:2000])
    p50 = final[("kvtier_step_seconds", (("quantile", "0.5"), ("swapped", "yes")))]
    assert 0 < p50 < math.inf
    holder.close()
    assert store.closed


def test_collector_in_a_registry_of_ones_own(tmp_path):
    """Mounted by the user: a store built by hand, reported under its label; closed stores drop out."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvtier.store import KVStore

    cfg = KVTierConfig(block_tokens=4, device_tokens=8, host_bytes=1 << 20, disk_path=str(tmp_path / "l3"),
                       codec="int8", policy="lru")
    store = KVStore(cfg, num_layers=1, kv_heads=1, head_dim=8, dtype=torch.float32, fingerprint="m-test")
    registry = CollectorRegistry()
    registry.register(kvtier.metrics.KVTierCollector([store]))
    seq = store.add_sequence()
    for _ in range(6):  # 24 tokens: 6 blocks through an L1 of 2
        store.append(seq, 0, torch.randn(1, 4, 8), torch.randn(1, 4, 8))
        store.end_step()
    store.gather(seq, 0)
    store.flush()
    label = kvtier.metrics.store_label(store)
    assert label.endswith("@" + str((tmp_path / "l3").resolve()))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    st = store.stats()
    for tier in ("l1", "l2"):
        [s] = [s for s in fams["kvtier_hits"].samples if s.labels == {"store": label, "tier": tier}]
        assert s.value == st["hits"][tier]
    assert st["swap_in_blocks"] > 0
    store.close()
    assert b"kvtier_hits_total" not in generate_latest(registry)


def test_serve_rejects_a_bad_port():
    with pytest.raises(ValueError, match="port"):
        kvtier.metrics.serve(70000)
