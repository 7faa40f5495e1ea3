"""Run by test_score_triton.py in a subprocess with TRITON_INTERPRET=1 (the interpreter must be
chosen before triton is first imported). Prints one JSON object: case id -> "ok" or the first
mismatch. The kernel (kvtier/store/score_triton.py) against the torch math it replaces on CUDA:
the logits themselves, then a store's selection and estimate with the kernel and without it
(and the decode step's select_with_rest, which calls the kernel once)."""
import itertools
import json
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from kvtier.store import score_triton as ST  # noqa: E402
from kvtier.store.table import dequantize_channels, quantize_channels, quantize_rows  # noqa: E402
from tests.store.conftest import make_store  # noqa: E402

# (kv heads, query rows, row width, rows a block, table rows, lo, hi): one query row and more
# than 32 (two programs' tiles, the second partly masked); widths 64/128/2*hd (Quest) and one
# not a power of two
LOGITS = [(2, 3, 64, 16, 20, 2, 17), (3, 5, 32, 2, 9, 0, 9), (1, 45, 128, 8, 6, 1, 5),
          (2, 1, 128, 1, 7, 0, 7), (2, 7, 80, 4, 5, 3, 5)]


def _close(got, want, what):
    if got.shape != want.shape or got.dtype != torch.float32:
        return f"{what}: {got.dtype}{tuple(got.shape)} vs {tuple(want.shape)}"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    tol = 1e-5 * max(1.0, want.abs().max().item() if want.numel() else 0.0)
    return "ok" if err <= tol else f"{what}: max error {err:.3g} > {tol:.3g}"


def logits_cases(out):
    g = torch.Generator().manual_seed(3)
    for i, (kvh, R, W, P, cap, lo, hi) in enumerate(LOGITS):
        q = torch.randn(kvh, R, W, generator=g)
        # channel offsets several times the spread, as RoPE'd keys have
        x = torch.randn(kvh, cap, P, W, generator=g) * 2 + torch.randn(kvh, 1, 1, W, generator=g) * 5
        a = 0.125
        packed = torch.empty(kvh, cap, P * W // 2, dtype=torch.uint8)
        sz = torch.empty(kvh, cap, 2 * W, dtype=torch.float16)
        for b in range(cap):
            packed[:, b], sz[:, b] = quantize_channels(x[:, b])
        rows = dequantize_channels(packed[:, lo:hi], sz[:, lo:hi], P).reshape(kvh, -1, W)
        out[f"logits-int4-{i}"] = _close(ST.digest_logits(q, packed, sz, lo, hi, P, a),
                                         torch.bmm(q, rows.transpose(1, 2)) * a, "int4")
        codes, rs = quantize_rows(x)
        d8 = codes.reshape(kvh, cap, P * W)
        want = torch.bmm(q, d8[:, lo:hi].reshape(kvh, -1, W).float().transpose(1, 2)) * a
        out[f"logits-int8-{i}"] = _close(ST.digest_logits(q, d8, rs, lo, hi, P, a),
                                         want * rs[:, lo:hi].reshape(kvh, 1, -1), "int8")
        for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            df = x.reshape(kvh, cap, P * W).to(dt)
            want = torch.bmm(q, df[:, lo:hi].reshape(kvh, -1, W).float().transpose(1, 2)) * a
            out[f"logits-{name}-{i}"] = _close(ST.digest_logits(q, df, None, lo, hi, P, a), want, name)
    empty = ST.digest_logits(torch.randn(2, 3, 64), torch.zeros(2, 4, 64), None, 2, 2, 1, 1.0)
    out["logits-empty-range"] = "ok" if empty.shape == (2, 3, 0) else f"shape {tuple(empty.shape)}"


STORES = [("int4", "centroid", 1), ("int4", "centroid", 4), ("int8", "centroid", 2), ("kv", "centroid", 1),
          ("int8", "quest", 16), ("kv", "quest", 16)]


class _Counting:
    """score_triton's interface, counting its calls."""

    def __init__(self, calls):
        self.calls = calls

    def digest_logits(self, *a, **kw):
        self.calls.append(a[3:5])
        return ST.digest_logits(*a, **kw)


def store_cases(out):
    bt, hd, kvh = 16, 64, 2
    for (dd, score, dt), per_head in itertools.product(STORES, (True, False)):
        case = f"store-{dd}-{score}-d{dt}-{'per_head' if per_head else 'shared'}"
        g = torch.Generator().manual_seed(len(out))
        st = make_store(None, num_layers=1, kv_heads=kvh, head_dim=hd, dtype=torch.float32, codec="fp32",
                        block_tokens=bt, device_tokens=64 * bt, host_bytes=1 << 22, budget_tokens=8 * bt,
                        sink_tokens=bt, window_tokens=2 * bt, attention="sparse", select_score=score,
                        digest_tokens=dt, digest_dtype=dd, select_heads="per_head" if per_head else "shared",
                        prefetch=False)
        sel = st.selector
        sel.compiled = False  # the torch math, the specification on every device
        seq = st.add_sequence()
        T = 40 * bt + 3
        k = torch.randn(kvh, T, hd, generator=g) * 2 + torch.randn(kvh, 1, hd, generator=g) * 4
        st.append(seq, 0, k, torch.randn(kvh, T, hd, generator=g))
        t = st.residency.tables[seq][0]
        res = "ok"
        for i in range(6):
            q = torch.randn(4 * kvh, 1 + i % 2, hd, generator=g) * (1 + i)
            sel.kernel = None
            want = sel.select(t, q, 8 * bt)
            west = sel.rest_estimate(t, q, want, hd ** -0.5) if score == "centroid" else None
            sel.kernel = ST
            got = sel.select(t, q, 8 * bt)
            if got != want:
                res = f"query {i}: selected {got} vs {want}"
                break
            if score == "centroid":
                est = sel.rest_estimate(t, q, want, hd ** -0.5)
                # the decode step's call: the kernel scores the digest once, selection and estimate
                calls = []
                sel.kernel = _Counting(calls)
                both, fused = sel.select_with_rest(t, q, 8 * bt, hd ** -0.5)
                sel.kernel = ST
                if both != want or len(calls) != 1:
                    res = f"query {i}: select_with_rest chose {both}, {len(calls)} kernel calls"
                    break
                for j, what in ((1, "lse"), (0, "out")):
                    r = "ok"
                    for e, how in ((est, "estimate"), (fused, "select_with_rest's estimate")):
                        r = _close(e[j], west[j], f"query {i} {how} {what}")
                        if r != "ok":
                            break
                    if r != "ok":
                        res = r
                        break
                if res != "ok":
                    break
        out[case] = res
        st.close()


def main():
    out = {}
    for fn in (logits_cases, store_cases):
        try:
            fn(out)
        except Exception as e:  # every case still reported
            out[fn.__name__] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
