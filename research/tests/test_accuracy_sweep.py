"""research/accuracy_sweep.py's pure parts: the paired bootstrap and the Pareto plot."""
import importlib.util
import math
import sys
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "accuracy_sweep", Path(__file__).resolve().parents[1] / "accuracy_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("accuracy_sweep", sweep)  # dataclasses resolve their module by name
_spec.loader.exec_module(sweep)


def test_bootstrap_is_paired_and_exact_for_a_constant_shift():
    g = torch.Generator().manual_seed(0)
    ref = [torch.rand(16, generator=g, dtype=torch.float64) for _ in range(5)]
    d, lo, hi = sweep.bootstrap_ci(ref, [r.clone() for r in ref], 200, 0)
    assert d == lo == hi == 0.0
    # every token 0.01 nats worse: exp(0.01) - 1 whatever windows are drawn (pairs resampled together)
    d, lo, hi = sweep.bootstrap_ci(ref, [r + 0.01 for r in ref], 200, 0)
    assert abs(d - math.expm1(0.01)) < 1e-9 and abs(lo - d) < 1e-9 and abs(hi - d) < 1e-9


def test_plot_writes_a_png(tmp_path):
    row = lambda d, b: {"delta_ppl": d, "ci95": [d - 0.01, d + 0.01], "bytes_per_token_end": b}  # noqa: E731
    doc = {"sources": {"pydoc": {"windows": 3, "rows": {
        "store int4 g32": row(0.0, 9000), "store importance 10/50": row(0.001, 9500),
        "kvtier int2 g32": row(0.06, 7000), "hqq int4": row(0.04, 7400)}}}}
    tiers = {"tiers": {"l1": 3000.0, "l2": 4000.0, "l3": 0.0}}  # fixed store rows: the line through them
    doc["sources"]["pydoc"]["rows"].update({"store int2 g32": dict(row(0.2, 7000), **tiers),
                                            "store int8 g32": dict(row(0.001, 14000), **tiers)})
    out = tmp_path / "pareto.png"
    sweep.plot(doc, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_store_specs_build_valid_configs():
    specs = sweep.default_store_specs() + sweep.mix_store_specs() + sweep.recall_store_specs()
    for s in specs + sweep.int8_store_specs() + sweep.pareto_store_specs():
        cfg = sweep.store_config(s, 64, None)
        codec = "bf16" if s.codec == "lossless" else s.codec
        assert (cfg.precision, cfg.codec, cfg.recall_reference) == (s.precision, codec, s.recall_reference)


def test_int8_rows_and_only():
    specs = sweep.int8_store_specs()
    picked = sweep.only(specs, "=store int8 g32,zero K")
    assert [s.name for s in picked] == ["store int8 g32", "store int8 g32 zero K", "store int8 g32 zero K+V"]
    assert sweep.store_config(picked[0], 64, None).codec_kwargs("int8", "value") == {
        "group_size": 32, "axis": "channel", "zero_point": True}  # the default
    cfg = sweep.store_config(picked[1], 64, None)
    assert (cfg.int8_zero_point, cfg.codec_kwargs("int8", "value")) == ("key", {"group_size": 32, "axis": "token"})
    assert len(sweep.only(specs, "store int8 g32")) == len(specs) - 1  # all but the lossless row


def test_value_codec_and_lossless_store_row():
    # a spec may give values their own codec: the bytes are the keys' codec's plus the values'
    from kvtier.compress import get_codec

    x = torch.randn(3, 128, 64, dtype=torch.bfloat16)  # [kv_heads, T, D], two 64-token blocks
    spec = sweep.Spec("k4v2", "kvtier", codec="int4", encoder="minmax", value_codec="int2", value_encoder="minmax")
    yk, nk = sweep._encode_decode_blocks(x, spec, "k", 64)
    yv, nv = sweep._encode_decode_blocks(x, spec, "v", 64)
    blocks = x.view(3, 2, 64, 64).transpose(0, 1).reshape(-1, 64, 64)
    assert nk == get_codec("int4", group_size=32, axis="channel").encode(blocks).nbytes
    assert nv == get_codec("int2", group_size=32, axis="token").encode(blocks).nbytes
    assert (yk.float() - x.float()).norm() < (yv.float() - x.float()).norm()  # int4 keys, int2 values
    names = [s.name for s in sweep.default_store_specs()]
    assert sweep.STORE_LOSSLESS in names and sweep.default_store_specs()[0].codec == "lossless"


def test_pool_windows_pairs_rows_with_the_lossless_store():
    import json

    def line(src, off, ref, lossless, row):
        return json.dumps({"window": {"source": src, "offset": off, "nll": {
            "ref": ref, sweep.STORE_LOSSLESS: lossless, "store int2 g32": row}}})

    lines = [line("pydoc", 1, [1.0, 2.0], [1.0, 2.0], [1.1, 2.1]), "not a window line",
             line("pydoc", 2, [0.5, 0.5], [0.6, 0.6], [0.7, 0.7])]
    rows = sweep.pool_windows(lines, n_boot=50)["pydoc"]
    assert rows["store int2 g32"]["windows"] == [1, 2]
    d, lo, hi = rows["store int2 g32"]["vs_store_lossless"]
    assert abs(d - math.expm1(0.1)) < 1e-9 and abs(lo - d) < 1e-9  # 0.1 nats per token worse in both windows
    assert rows["store int2 g32"]["delta_ppl"] > d  # the lossless store is itself above ref in window 2
    assert "vs_store_lossless" not in rows[sweep.STORE_LOSSLESS]


def test_pool_windows_compares_store_rows_with_the_chunked_reference():
    import json

    lines = [json.dumps({"window": {"source": "squad", "offset": o, "nll": {
        "ref": [1.0, 1.0], sweep.REF_CHUNKED: [1.2, 1.2], "store int8 g32": [1.2, 1.2],
        "hqq int8 chunked": [1.3, 1.3], "kvtier int8 g32": [1.0, 1.0]}}}) for o in (3, 4)]
    rows = sweep.pool_windows(lines, n_boot=50)["squad"]
    assert rows["store int8 g32"]["against"] == sweep.REF_CHUNKED and rows["store int8 g32"]["delta_ppl"] == 0.0
    assert abs(rows["hqq int8 chunked"]["delta_ppl"] - math.expm1(0.1)) < 1e-9
    # the chunked reference itself and the simulated rows stay against the single prefill
    assert rows[sweep.REF_CHUNKED]["against"] == "ref"
    assert abs(rows[sweep.REF_CHUNKED]["delta_ppl"] - math.expm1(0.2)) < 1e-9
    assert rows["kvtier int8 g32"]["delta_ppl"] == 0.0


def test_lossless_store_row_takes_the_model_dtype_codec():
    spec = sweep.int8_store_specs()[0]
    assert spec.name == sweep.STORE_LOSSLESS and spec.attention_math == "sdpa"
    got = {dt: sweep.store_config(spec, 64, None, dt).codec for dt in (torch.bfloat16, torch.float16, torch.float32)}
    assert got == {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def test_importance_rows_against_the_fixed_rows():
    def row(d, l1l2, l3=0.0):
        return {"delta_ppl": d, "bytes_per_token_end": l1l2 + l3, "tiers": {"l1": 1000.0, "l2": l1l2 - 1000, "l3": l3}}

    rows = {"store int2 g32": row(0.10, 7000), "store int4 g32": row(0.01, 10000), "store int8 g32": row(-0.005, 14000),
            "store importance a": row(0.02, 9000, l3=4000), "store importance b": row(0.02, 12000),
            "store importance c": row(0.0, 6000), "ref chunked": {"delta_ppl": 0.0, "bytes_per_token_end": 1.0}}
    fast = sweep.against_fixed(rows, sweep.l1_l2_bytes)
    assert set(fast) == {"store importance a", "store importance b", "store importance c"}
    # 0.02 where the int2-int4 line is at 0.10 - 0.09 * 2/3 = 0.04: below it, undominated
    assert fast["store importance a"]["dominated_by"] == []
    assert abs(fast["store importance a"]["minus_fixed_line"] + 0.02) < 1e-12
    # more bytes than int4 and a higher dppl: dominated, above the int4-int8 line (0.0025 at 12,000)
    assert fast["store importance b"]["dominated_by"] == ["store int4 g32"]
    assert abs(fast["store importance b"]["minus_fixed_line"] - 0.0175) < 1e-12
    assert fast["store importance c"] == {"dominated_by": [], "minus_fixed_line": None}  # fewer bytes than any
    # counting its L3 backups, a's 13,000 B/token sit above int4's at a higher dppl: dominated
    assert sweep.against_fixed(rows, sweep.all_tier_bytes)["store importance a"]["dominated_by"] == ["store int4 g32"]


def test_paired_vs_fixed_pairs_windows():
    g = torch.Generator().manual_seed(1)
    fixed = [torch.rand(8, generator=g, dtype=torch.float64) for _ in range(3)]
    nll = {"ref": fixed, "store int4 g32": fixed, "store importance x": [f + 0.01 for f in fixed]}
    got = sweep.paired_vs_fixed(nll, 100, 0)
    assert list(got) == ["store importance x"] and list(got["store importance x"]) == ["store int4 g32"]
    d, lo, hi = got["store importance x"]["store int4 g32"]
    assert abs(d - math.expm1(0.01)) < 1e-9 and abs(lo - d) < 1e-9 and abs(hi - d) < 1e-9


def test_pool_windows_merges_runs_of_one_window():
    import json

    def line(off, nll):
        return json.dumps({"window": {"source": "squad", "offset": off, "nll": nll}})

    ref, fixed = [1.0, 1.0], [1.2, 1.2]
    lines = [line(7, {"ref": ref, sweep.REF_CHUNKED: ref, "store int4 g32": fixed}),
             line(7, {"ref": ref, sweep.REF_CHUNKED: ref, "store importance x": [1.1, 1.1]}),  # another run
             line(9, {"ref": ref, sweep.REF_CHUNKED: ref, "store importance x": [1.1, 1.1]})]
    rows = sweep.pool_windows(lines, n_boot=50)["squad"]
    assert rows["store importance x"]["windows"] == [7, 9] and rows["store int4 g32"]["windows"] == [7]
    d, lo, hi = rows["store importance x"]["vs_fixed"]["store int4 g32"]  # window 7 only: the one holding both
    assert abs(d - math.expm1(-0.1)) < 1e-9 and abs(hi - d) < 1e-9
    assert rows["store importance x"]["against"] == sweep.REF_CHUNKED


def test_int2_rows_pre_rope_and_kept_channels():
    """--int2 store rows set int2_key_outliers; the simulated pre-RoPE rows rotate keys back by
    their cache positions (``"block"``: by their offsets in their block) around the codec, and
    the kept-channel rows are the key codec's own ``outliers`` (its bytes)."""
    from kvtier.compress import get_codec
    from rope import rotate

    for s in sweep.int2_store_specs():
        cfg = sweep.store_config(s, 64, None)
        if s.int2_key_outliers is not None:
            assert cfg.int2_key_outliers == s.int2_key_outliers
    inv = 1.0 / (100000 ** (torch.arange(0, 64, 2).float() / 64))
    x = torch.randn(3, 128, 64, dtype=torch.bfloat16)  # [kv_heads, T, D], two 64-token blocks at 64, 128
    c = get_codec("int2", group_size=32, axis="channel")
    blocks = lambda t: t.view(3, 2, 64, 64).transpose(0, 1).reshape(-1, 64, 64)  # noqa: E731
    unblock = lambda t: t.view(2, 3, 64, 64).transpose(0, 1).reshape(3, 128, 64)  # noqa: E731
    pre = sweep.Spec("pre", "kvtier", codec="int2", key_rope="pre")
    y, n = sweep._encode_decode_blocks(x, pre, "k", 64, 64, inv)
    want = rotate(unblock(c.decode(c.encode(blocks(rotate(x, 64, inv, inverse=True))))), 64, inv)
    assert torch.equal(y, want) and n == c.encode(blocks(x)).nbytes
    blk = sweep.Spec("blk", "kvtier", codec="int2", key_rope="block")
    y0, _ = sweep._encode_decode_blocks(x, blk, "k", 64, 0, inv)
    y1, _ = sweep._encode_decode_blocks(x, blk, "k", 64, 640, inv)
    assert torch.equal(y0, y1)  # the start position does not matter
    kept = sweep.Spec("k4", "kvtier", codec="int2", key_outliers=4)
    y, n = sweep._encode_decode_blocks(x, kept, "k", 64)
    c4 = get_codec("int2", group_size=32, axis="channel", outliers=4)
    assert n == c4.encode(blocks(x)).nbytes and torch.equal(y, unblock(c4.decode(c4.encode(blocks(x)))))


def test_minus_line_ci_resamples_the_row_and_its_fixed_neighbours_together():
    import json

    def row(l1l2):
        return {"delta_ppl": 0.0, "bytes_per_token_end": l1l2, "tiers": {"l1": 1000.0, "l2": l1l2 - 1000, "l3": 0.0}}

    g = torch.Generator().manual_seed(2)
    ref = [torch.rand(8, generator=g, dtype=torch.float64) for _ in range(4)]
    # every token shifted by a constant per row: the interval collapses onto the point
    shift = {"store int2 g32": 0.05, "store int4 g32": 0.01, "store importance x": 0.02, "store importance far": 0.0}
    nll = {n: [r + s for r in ref] for n, s in shift.items()}
    rows = {"store int2 g32": row(7000), "store int4 g32": row(10000), "store importance x": row(8500),
            "store importance far": row(20000)}
    got = sweep.minus_line_ci(nll, ref, rows, sweep.l1_l2_bytes, 100, 0)
    assert list(got) == ["store importance x"]  # outside the fixed rows' range: no line there
    want = math.expm1(0.02) - (0.5 * math.expm1(0.05) + 0.5 * math.expm1(0.01))
    d, lo, hi = got["store importance x"]
    assert abs(d - want) < 1e-12 and abs(lo - want) < 1e-9 and abs(hi - want) < 1e-9 and d < 0
    # the same over merged window lines (the importance row from another run on the same windows)
    lines = [json.dumps({"window": {"source": "s", "offset": i, "nll": {
        sweep.REF_CHUNKED: ref[i].tolist(), **{n: nll[n][i].tolist() for n in part}}}})
        for part in (("store int2 g32", "store int4 g32"), ("store importance x",)) for i in range(4)]
    pooled = sweep.pooled_line_ci(sweep.merge_windows(lines)["s"], rows, sweep.l1_l2_bytes, 100, 0)
    assert abs(pooled["store importance x"][0] - want) < 1e-12


def test_cheap_cold_rows_set_the_cold_codecs_kept_channels():
    specs = {s.name: s for s in sweep.pareto_store_specs()}
    cfg = sweep.store_config(specs["store importance int4 / int2 K+0 75% no recall"], 64, None)
    assert cfg.cold_key_outliers == 0 and "outliers" not in cfg.codec_kwargs("int2", "key")
    assert math.isinf(cfg.recall_mass) and cfg.cold_fraction == 0.75
    base2 = sweep.store_config(specs["store importance int4 25% / int2"], 64, None)
    assert (base2.codec, base2.heavy_codec, base2.codec_kwargs("int2", "key")["outliers"]) == ("int2", "int4", 8)


def test_teacher_forced_runs_after_forward_after_every_forward():
    from types import SimpleNamespace

    calls = []
    model = lambda input_ids, cache, use_cache: SimpleNamespace(  # noqa: E731
        logits=torch.zeros(1, input_ids.shape[1], 5))
    nll = sweep.teacher_forced(model, None, torch.arange(10) % 5, torch.arange(5), 4, 2,
                               after_forward=lambda: calls.append(1))
    assert len(calls) == 3 + 2  # ctx in 4-token chunks, cont[:-1] in 2-token ones
    assert nll.shape == (5,) and torch.allclose(nll, torch.full((5,), math.log(5), dtype=torch.float64))


def test_add_windows_weights_bytes_by_windows():
    def src(offsets, b):
        return {"offsets": offsets, "windows": len(offsets), "rows": {
            "store int4 g32": {"delta_ppl": 0.0, "bytes_per_token_end": b, "tiers": {"l1": 1.0, "l2": b - 1, "l3": 0.0}}}}

    have, got = src([1, 2, 3], 100.0), src([7], 200.0)
    got["rows"]["store importance x"] = {"delta_ppl": 0.0, "bytes_per_token_end": 5.0}
    sweep.add_windows(have, got)
    row = have["rows"]["store int4 g32"]
    assert row["bytes_per_token_end"] == 125.0 and row["tiers"]["l2"] == 124.0
    assert have["offsets"] == [1, 2, 3, 7] and have["windows"] == 4 and "store importance x" in have["rows"]


def test_pareto_table_has_a_line_per_store_row():
    def row(d, b):
        return {"delta_ppl": d, "ci95": [d - 0.01, d + 0.01], "bytes_per_token_end": b,
                "tiers": {"l1": 1000.0, "l2": b - 1000, "l3": 0.0}}

    rows = {"store int2 g32": row(0.05, 7000), "store int4 g32": row(0.0, 9000), "store importance x": row(0.01, 8000),
            "ref chunked": {"delta_ppl": 0.0, "ci95": [0, 0], "bytes_per_token_end": 1.0}}
    standing = {"all tiers": sweep.against_fixed(rows, sweep.all_tier_bytes)}
    standing["all tiers"]["store importance x"]["minus_fixed_line_ci"] = [-0.015, -0.02, -0.01]
    rows["store importance x"]["windows"] = [1, 2]  # pooled: the windows holding it
    table = sweep.pareto_table({"sources": {"pydoc": {"rows": rows, "against_fixed": standing, "windows": 3}}})
    lines = table.splitlines()
    assert len(lines) == 2 + 3 and "ref chunked" not in table  # header, rule, the three store rows
    assert lines[-1] == "| importance x | +1.00% [+0.00, +2.00] | 2 | 8,000 | 8,000 | -1.50% [-2.00, -1.00] |"
    assert lines[2].split(" | ")[2] == "3"  # the source's window count where the row has none


def test_key_transform_rows_rotate_keys_only():
    """The hadamard rows quantize keys with the codec's ``transform`` and values without it."""
    from kvtier.compress import get_codec

    x = torch.randn(3, 128, 64, dtype=torch.bfloat16)  # [kv_heads, T, D]
    blocks = lambda t: t.view(3, 2, 64, 64).transpose(0, 1).reshape(-1, 64, 64)  # noqa: E731
    unblock = lambda t: t.view(2, 3, 64, 64).transpose(0, 1).reshape(3, 128, 64)  # noqa: E731
    rows = {s.name: s for s in sweep.default_specs()}
    spec = rows["kvtier K int4 hadamard V int2 g32"]
    kc = get_codec("int4", group_size=32, axis="channel", transform="hadamard")
    vc = get_codec("int2", group_size=32, axis="token", encoder="minmax")
    yk, _ = sweep._encode_decode_blocks(x, spec, "k", 64)
    yv, _ = sweep._encode_decode_blocks(x, spec, "v", 64)
    assert torch.equal(yk, unblock(kc.decode(kc.encode(blocks(x)))))
    assert torch.equal(yv, unblock(vc.decode(vc.encode(blocks(x)))))
    assert rows["kvtier int2 g32 K hadamard token"].key_axis == "token"
