"""What kvtier's metrics cost: a Prometheus scrape of a store, the per-step bookkeeping the TPOT
split adds, and the vLLM connector's per-step delta, each as a ratio to work measured in the same
run.

- scrape: ``generate_latest`` of a registry holding ``KVTierCollector([store])``, against the
  store's own ``stats()`` (what the scrape reads) on a store whose blocks are in L1, L2 and L3.
- step bookkeeping: the swap-in counter read and the extra latency sample ``end_step`` takes
  per step, against one decode step of the same store (append + gather of every layer + end_step).
- vLLM delta: ``counters.Deltas.take()`` (what ``get_kv_connector_stats`` runs on the worker
  after every engine step), against loading 4 blocks of every layer from L2 (``fetch_layer``).

    python bench/bench_metrics.py            # a 4-sequence, 1024-token store; 200 repetitions
    python bench/bench_metrics.py --smoke    # seconds; run by `make bench-smoke`
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

import kvtier.metrics  # noqa: E402
from kvtier.config import KVTierConfig  # noqa: E402
from kvtier.vllm.blocks import BlockShape, BlockStore, connector_config  # noqa: E402
from kvtier.vllm.counters import Deltas  # noqa: E402
from kvtier.store import KVStore  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK = 8, 2, 64, 16


def _median_s(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _store(tmp: str, seqs: int, tokens: int) -> tuple[KVStore, list[int]]:
    cfg = KVTierConfig(block_tokens=BLOCK, device_tokens=128, host_bytes=256 << 10, disk_path=os.path.join(tmp, "l3"),
                       codec="int8", policy="lru", max_sequences=seqs)
    store = KVStore(cfg, num_layers=LAYERS, kv_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                    fingerprint="bench-metrics")
    ids = [store.add_sequence() for _ in range(seqs)]
    for _ in range(tokens // BLOCK):
        for s in ids:
            for layer in range(LAYERS):
                store.append(s, layer, torch.randn(HEADS, BLOCK, HEAD_DIM), torch.randn(HEADS, BLOCK, HEAD_DIM))
        store.end_step()
    store.flush()
    return store, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="small store, few repetitions")
    args = ap.parse_args()
    torch.set_num_threads(1)
    reps = 20 if args.smoke else 200
    seqs, tokens = (2, 256) if args.smoke else (4, 1024)
    with tempfile.TemporaryDirectory() as tmp:
        store, ids = _store(tmp, seqs, tokens)
        st = store.stats()
        assert st["copies"]["l2"] > 0 and st["copies"]["l3"] > 0, st["copies"]
        registry = CollectorRegistry()
        registry.register(kvtier.metrics.KVTierCollector([store]))
        t_stats = _median_s(store.stats, reps)
        t_scrape = _median_s(lambda: generate_latest(registry), reps)

        def step():
            for layer in range(LAYERS):
                store.append(ids[0], layer, torch.randn(HEADS, 1, HEAD_DIM), torch.randn(HEADS, 1, HEAD_DIM))
                store.gather(ids[0], layer)
            store.end_step()

        t_step = _median_s(step, reps)
        c = store.counters

        def bookkeeping():
            c["swap_in_blocks"]
            c.sample("step_unswapped", 0.0)

        t_book = _median_s(bookkeeping, reps * 10)
        store.close()

        shape = BlockShape(num_layers=LAYERS, kv_heads=HEADS, block_tokens=BLOCK, head_dim=HEAD_DIM,
                           dtype=torch.float32)
        cfg, codec = connector_config({"codec": "int8", "disk_path": os.path.join(tmp, "vllm-l3")}, BLOCK)
        bs = BlockStore(cfg, codec, shape, "bench-metrics")
        hashes = [f"h{i}" for i in range(4)]
        bs.save(hashes, [torch.randn(4, HEADS, 2, BLOCK, HEAD_DIM) for _ in range(LAYERS)])
        bs.flush()
        deltas = Deltas(bs)

        def load4():
            counts = {"l2": 0, "l3": 0, "l4": 0}
            for layer in range(LAYERS):
                assert None not in bs.fetch_layer(layer, hashes, counts)

        t_load = _median_s(load4, reps)
        t_take = _median_s(deltas.take, reps)
        bs.close()

    print(f"store: {seqs} sequences x {tokens} tokens x {LAYERS} layers, blocks in L1 {st['copies']['l1']}, "
          f"L2 {st['copies']['l2']}, L3 {st['copies']['l3']}; medians of {reps} runs")
    print(f"{'what':44s} {'us':>10s} {'ratio':>8s}  to")
    print(f"{'scrape (generate_latest, 1 store)':44s} {t_scrape * 1e6:10.1f} {t_scrape / t_stats:8.2f}  store.stats()")
    print(f"{'TPOT split bookkeeping per step':44s} {t_book * 1e6:10.2f} {t_book / t_step:8.1e}  one decode step "
          f"({t_step * 1e6:.0f} us)")
    print(f"{'vLLM Deltas.take() per engine step':44s} {t_take * 1e6:10.1f} {t_take / t_load:8.3f}  loading 4 blocks "
          f"x {LAYERS} layers from L2 ({t_load * 1e6:.0f} us)")


if __name__ == "__main__":
    main()
