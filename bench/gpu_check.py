"""The CUDA paths in one short script: run it on a GPU machine (a few minutes).

    python bench/gpu_check.py            # checks + timings on cuda:0
    python bench/gpu_check.py --device cpu --quick   # same checks on the CPU path (no Triton)

Checks (each prints PASS/FAIL; exit status 1 if any fails):
1. Triton quantize/dequantize kernels bit-identical to the torch reference (int8/int4/int2,
   both axes, fp16/bf16, odd shapes).
2. Kernel throughput: quantize and dequantize GB/s of fp16 input as ratios to ``copy_`` of the
   same bytes on the same device, synchronized, after warm-up.
3. KVStore on the device: fp16 codec, tiny L1/L2 so blocks reach L3 through the side stream and
   pinned buffers; every token reads back bit-exact; swap latencies from stats(). Sparse mode:
   gather_view (views of the per-table L1 regions) equals the appended tokens and gather_blocks.
4. Sparse block scoring at Llama-3-8B's shape (8 kv heads, head_dim 128, 32 query heads; a key
   row per token in 4 bits, 128k tokens, 32k with --quick): the Triton digest scorer selects
   and estimates what the torch math does; time per selection + estimate (the default sparse
   step's) and the extra memory a call allocates, both ways. On CPU only under
   ``TRITON_INTERPRET=1``: the check alone, at 1k tokens and 2 kv heads (the interpreter is slow).
5. TieredCache generate() on SmolLM2 (fp16 codec, dense, L1 far below the context) equals
   DynamicCache's greedy tokens; int4 sparse decode tokens/s as a ratio to DynamicCache.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

FAILS: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILS.append(name)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timeit(fn, dev, reps: int) -> float:
    for _ in range(3):
        fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(dev)
    return (time.perf_counter() - t0) / reps


def kernels(dev: torch.device, quick: bool) -> None:
    from kvtier.compress import reference as ref

    if dev.type != "cuda":
        print("skip kernels: Triton runs on CUDA (CPU tests cover it under TRITON_INTERPRET=1)")
        return
    from kvtier.compress import triton_kernels as tk

    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(3, 64, 64), (3, 37, 64), (8, 128, 128), (2, 5, 96)]
    for dtype in (torch.float16, torch.bfloat16):
        for shape in shapes:
            x = (torch.randn(shape, generator=g, device=dev) * 3).to(dtype)
            for bits in (8, 4, 2):
                for axis in ("token", "channel"):
                    gs = 32
                    try:
                        rq, rs, rz = ref.quantize_ref(x, bits, gs, axis)
                    except ValueError:
                        continue  # shape the reference refuses (group does not divide)
                    q, s, z = tk.quantize(x, bits, gs, axis)
                    same = torch.equal(q, rq) and torch.equal(s, rs) and (z is None or torch.equal(z, rz))
                    out = tk.dequantize(q, s, z, bits, gs, axis, shape, dtype)
                    rout = ref.dequantize_ref(rq, rs, rz, bits, gs, axis, shape, dtype)
                    check(f"triton int{bits} {axis} {dtype} {shape}", same and torch.equal(out, rout))
    # throughput at a realistic eviction batch: 64 blocks of SmolLM2 [3, 64, 64] fp16
    x = torch.randn(64 * 3, 64, 64, device=dev, dtype=torch.float16)
    dst = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    reps = 20 if quick else 200
    t_copy = timeit(lambda: dst.copy_(x), dev, reps)
    for bits, axis in ((8, "token"), (4, "channel"), (4, "token"), (2, "channel")):
        q, s, z = tk.quantize(x, bits, 32, axis)
        tq = timeit(lambda: tk.quantize(x, bits, 32, axis), dev, reps)
        td = timeit(lambda: tk.dequantize(q, s, z, bits, 32, axis, tuple(x.shape), x.dtype), dev, reps)
        print(f"int{bits} {axis}: quantize {nbytes / tq / 1e9:.1f} GB/s ({t_copy / tq:.2f}x copy_), "
              f"dequantize {nbytes / td / 1e9:.1f} GB/s ({t_copy / td:.2f}x copy_); copy_ {nbytes / t_copy / 1e9:.1f} GB/s")


def store(dev: torch.device, quick: bool) -> None:
    from kvtier.config import KVTierConfig
    from kvtier.store import KVStore

    with tempfile.TemporaryDirectory() as tmp:
        cfg = KVTierConfig(block_tokens=16, device_tokens=64, host_bytes=256 << 10, disk_path=tmp, codec="fp16",
                           policy="lru", attention="dense")
        st = KVStore(cfg, num_layers=4, kv_heads=3, head_dim=64, dtype=torch.float16, device=dev,
                     fingerprint="gpu-check")
        seqs = [st.add_sequence() for _ in range(3)]
        truth = {(s, l): [] for s in seqs for l in range(4)}
        g = torch.Generator(device=dev).manual_seed(1)
        steps = 150 if quick else 600
        for step in range(steps):
            for s in seqs:
                for l in range(4):
                    t = 7 if step == 0 else 1
                    k = torch.randn(3, t, 64, generator=g, device=dev, dtype=torch.float16)
                    v = torch.randn(3, t, 64, generator=g, device=dev, dtype=torch.float16)
                    st.append(s, l, k, v)
                    truth[(s, l)].append((k, v))
            st.end_step()
        ok = True
        for (s, l), parts in truth.items():
            K, V = st.gather(s, l)
            ok &= torch.equal(K, torch.cat([p[0] for p in parts], 1)) and torch.equal(V, torch.cat([p[1] for p in parts], 1))
        stats = st.stats()
        st.close()
        check("store fp16 round trip through L2/L3 on " + dev.type, ok,
              f"(blocks {stats['blocks']}, swap-in p50/p99 {stats['swap_in_latency']}, "
              f"swap-out {stats['swap_out_latency']})")

        # sparse: gather_view's K/V (views of each table's L1 region, blocks in the returned order)
        # equal the copying gather_blocks' and the appended tokens, while selections change and
        # blocks move between regions, L2 and L3 (swap-outs on the side stream)
        cfg = KVTierConfig(block_tokens=16, device_tokens=256, budget_tokens=128, host_bytes=64 << 10,
                           disk_path=tmp + "/sparse", codec="fp16", policy="h2o", attention="sparse")
        st = KVStore(cfg, num_layers=2, kv_heads=3, head_dim=64, dtype=torch.float16, device=dev)
        s = st.add_sequence()
        kv = {l: ([], []) for l in range(2)}
        ok, views = True, 0
        for step in range(100 if quick else 400):
            for l in range(2):
                t = 200 if step == 0 else 1
                k = torch.randn(3, t, 64, generator=g, device=dev, dtype=torch.float16)
                v = torch.randn(3, t, 64, generator=g, device=dev, dtype=torch.float16)
                st.append(s, l, k, v)
                kv[l][0].append(k)
                kv[l][1].append(v)
                sel = st.select(s, l, torch.randn(9, 1, 64, generator=g, device=dev, dtype=torch.float16))
                K, V, pos, order = st.gather_view(s, l, sel)
                rk, rv = torch.cat(kv[l][0], 1), torch.cat(kv[l][1], 1)
                ok &= torch.equal(K, rk[:, pos]) and torch.equal(V, rv[:, pos]) and sorted(order[:-1]) == sel
                views += K.untyped_storage().data_ptr() == st.l1.storage.untyped_storage().data_ptr()
                if step % 10 == 0:  # the copying gather agrees
                    Kc, _, pc = st.gather_blocks(s, l, sel)
                    ok &= torch.equal(Kc, rk[:, pc])
                st.observe(s, l, order, torch.rand(len(order), device=dev))
            st.end_step()
        g_stats = st.stats()["gather"]
        st.close()
        check("store sparse gather_view == appended tokens on " + dev.type, ok,
              f"({views} of {2 * (100 if quick else 400)} reads were views; gather stats {g_stats})")


def scorer(dev: torch.device, quick: bool) -> None:
    import os

    from kvtier.config import KVTierConfig
    from kvtier.store import KVStore

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if dev.type != "cuda" and not interpret:
        print("skip scorer: the Triton scorer runs on CUDA (or on CPU under TRITON_INTERPRET=1)")
        return
    from kvtier.store import score_triton

    kvh, hd, qh = (8, 128, 32) if dev.type == "cuda" else (2, 128, 8)  # the interpreter is slow
    ctx = 1024 if dev.type != "cuda" else (32768 if quick else 131072)
    budget = max(ctx * 3 // 100, 256) // 16 * 16  # 3% of the context; room for candidates at 1k
    cfg = KVTierConfig(block_tokens=16, device_tokens=ctx + 64, budget_tokens=budget,
                       host_bytes=1 << 20, codec="fp16", policy="lru", attention="sparse", prefetch=False)
    st = KVStore(cfg, num_layers=1, kv_heads=kvh, head_dim=hd, dtype=torch.float16, device=dev)
    s = st.add_sequence()
    g = torch.Generator(device=dev).manual_seed(2)
    for lo in range(0, ctx, 4096):
        n = min(4096, ctx - lo)
        k = torch.randn(kvh, n, hd, generator=g, device=dev, dtype=torch.float16)
        st.append(s, 0, k, torch.randn(kvh, n, hd, generator=g, device=dev, dtype=torch.float16))
    sel = st.selector
    sel.compiled = False  # on CPU: the torch math or the kernel, not score_cpu's C scorer
    table = st.residency.tables[s][0]
    q = torch.randn(qh, 1, hd, generator=g, device=dev, dtype=torch.float16)
    kernel = score_triton

    def run(with_kernel):
        # the default sparse step: selection, then the estimate of the blocks it left out
        sel.kernel = kernel if with_kernel else None
        return sel.select_with_rest(table, q, cfg.budget_tokens, hd ** -0.5)

    (a, ea), (b, eb) = run(True), run(False)
    same = a == b and all(torch.allclose(x, y, rtol=1e-4, atol=1e-4) for x, y in zip(ea, eb))
    check(f"scorer: Triton selection and estimate == torch's at {ctx} tokens on {dev.type}", same,
          f"(digest {table.digest.dtype}, {table.n_sealed} blocks)")
    if dev.type != "cuda":  # the interpreter's time says nothing of the kernel's
        st.close()
        return
    res = {}
    for name, flag in (("triton", True), ("torch", False)):
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        run(flag)
        torch.cuda.synchronize(dev)
        res[name] = (timeit(lambda: run(flag), dev, 50), torch.cuda.max_memory_allocated(dev) - base)
    st.close()
    (tt, mt), (tr, mr) = res["triton"], res["torch"]
    print(f"select + estimate at {ctx} tokens, {kvh} kv heads, head_dim {hd}: Triton {tt * 1e3:.3f} ms, torch "
          f"{tr * 1e3:.3f} ms ({tr / tt:.2f}x); memory allocated by a call: Triton {mt / 2**20:.1f} MiB, "
          f"torch {mr / 2**20:.1f} MiB")


def model(dev: torch.device, quick: bool) -> None:
    from transformers import DynamicCache

    import kvtier
    from kvtier.config import KVTierConfig
    from kvtier.models import load_model, load_text

    # the lossless codec must match the model dtype: fp16 on CUDA, bf16 (the fast one) on CPU
    dtype, lossless = (torch.float16, "fp16") if dev.type == "cuda" else (torch.bfloat16, "bf16")
    m, tok = load_model(dtype=dtype, device=dev)
    ids = tok(load_text()[:20000], return_tensors="pt")["input_ids"][:, : (512 if quick else 2048)].to(dev)
    new = 32 if quick else 64
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        ref = m.generate(ids, cache=DynamicCache(config=m.config), max_new_tokens=new, do_sample=False)
        cfg = KVTierConfig(block_tokens=32, device_tokens=128, host_bytes=1 << 20, disk_path=tmp, codec=lossless,
                           attention="dense", policy="lru")
        cache = kvtier.attach(m, cfg)
        got = m.generate(ids, cache=cache, max_new_tokens=new, do_sample=False)
        st = cache.stats()
        cache.close()
        check(f"generate {lossless} dense == DynamicCache on {dev.type}", torch.equal(ref, got),
              f"(blocks per tier {st['blocks']})")

        def decode_rate(make):
            cache = make()
            out = m(input_ids=ids, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(new):
                out = m(input_ids=nxt, cache=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
            sync(dev)
            rate = new / (time.perf_counter() - t0)
            if hasattr(cache, "close"):
                cache.close()
            return rate

        base = decode_rate(lambda: DynamicCache(config=m.config))
        hot = ids.shape[1] // 4 // 32 * 32
        sparse = decode_rate(lambda: kvtier.attach(m, KVTierConfig(
            block_tokens=32, device_tokens=hot, budget_tokens=hot, host_bytes=64 << 20, disk_path=tmp,
            codec="int4", attention="sparse", policy="h2o")))
        print(f"decode at {ids.shape[1]} context: DynamicCache {base:.1f} tok/s, kvtier int4 sparse L1=25% "
              f"{sparse:.1f} tok/s ({sparse / base:.2f}x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu, or on a GPU machine")
        return 2
    if dev.type == "cuda":
        print(torch.cuda.get_device_name(dev), "torch", torch.__version__)
    for step in (kernels, store, scorer) + (() if a.skip_model else (model,)):
        try:
            step(dev, a.quick)
        except Exception as e:  # report every stage, then fail at the end
            check(step.__name__, False, f"raised {type(e).__name__}: {e}")
    print(f"{len(FAILS)} failed" + (f": {FAILS}" if FAILS else ""))
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
