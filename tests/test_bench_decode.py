"""bench/bench_decode.py's command line: --model, its checks, and what a --base child is given.

No model is loaded here (`make bench-smoke` runs the bench itself): every check below fails
before a load, or only builds an argv.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode_under_test", ROOT / "bench" / "bench_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model_dir(tmp_path: Path, positions: int) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    return d


def test_defaults_keep_the_default_model(bench):
    args = bench.parse_args([])
    assert args.model is None and args.contexts == [1024, 4096] and args.l1_fraction == 0.25
    assert args.configs[0] == "dynamic"
    smoke = bench.parse_args(["--smoke"])
    assert (smoke.model, smoke.contexts, smoke.steps, smoke.threads) == (None, [128], 2, 1)


def test_child_argv_carries_the_model_directory_and_settings(bench, tmp_path):
    d = _model_dir(tmp_path, 32768)
    args = bench.parse_args(["--model", str(d), "--base", "a4e1479", "--contexts", "1024", "32768",
                             "--configs", "kvtier-int4-sparse", "--l1-fraction", "0.03", "--steps", "48",
                             "--threads", "1", "--dtype", "bfloat16", "--rounds", "2",
                             "--prefill-cache", "prefills"])
    cmd = bench.child_argv(args, 32768, str(tmp_path / "out.json"), str(d))
    assert cmd[1] == str(ROOT / "bench" / "bench_decode.py")
    assert "--base" not in cmd and "--rounds" not in cmd  # a child measures once, its own tree
    child = bench.parse_args(cmd[2:])
    assert child.model == str(d)
    assert (child.contexts, child.steps, child.l1_fraction, child.threads, child.dtype) == ([32768], 48, 0.03, 1,
                                                                                           "bfloat16")
    assert child.configs == ["dynamic", "kvtier-int4-sparse"] and child.json == str(tmp_path / "out.json")
    assert child.prefill_cache == args.prefill_cache and Path(child.prefill_cache).is_absolute()
    # blocks: KVTierConfig's default per attention mode, resolved here, so an older tree's child
    # gets this tree's sizes
    assert (child.block_tokens_sparse, child.block_tokens_dense) == (16, 64)
    assert bench.row_block_tokens(child, "kvtier-int4-sparse") == 16
    assert bench.row_block_tokens(child, "kvtier-int8-dense") == 64
    given = bench.parse_args(["--block-tokens", "32", "--base", "a4e1479"])
    child = bench.parse_args(bench.child_argv(given, 1024, "o.json", None)[2:])
    assert (child.block_tokens_sparse, child.block_tokens_dense) == (32, 32)
    with pytest.raises(SystemExit, match="--block-tokens must be >= 1"):
        bench.parse_args(["--block-tokens", "0"])
    # the default model: the child gets no --model and loads its tree's default
    assert "--model" not in bench.child_argv(bench.parse_args([]), 1024, "o.json", None)


def test_model_directory_positions_bound_the_contexts(bench, tmp_path):
    d = _model_dir(tmp_path, 4096)
    assert bench.resolve_model(str(d), [1024, 4096]) == str(d)
    with pytest.raises(ValueError, match=r"--contexts \[8192\] exceed the model's 4,096 positions"):
        bench.main(["--model", str(d), "--contexts", "1024", "8192", "--dtype", "float32"])


def test_embedded_model_positions_checked_before_conversion(bench):
    with pytest.raises(ValueError, match="32,768 positions"):
        bench.resolve_model("qwen2.5-coder-0.5b", [40000])
    with pytest.raises(ValueError, match="8,192 positions"):
        bench.resolve_model(None, [16384])


def test_bad_model_and_l1_fraction_refused(bench):
    with pytest.raises(ValueError, match=r"--model 'qwen' is neither an embedded model \(smollm2-135m, qwen2.5"):
        bench.main(["--model", "qwen", "--dtype", "float32"])
    with pytest.raises(ValueError, match=r"--l1-fraction must be in \(0, 1\]"):
        bench.parse_args(["--l1-fraction", "0"])


def test_kept_reference_prefill_decodes_the_same_tokens(bench, tmp_path):
    """The reference's prefill computed and kept, then read back: the same greedy tokens, and the
    kvtier row decodes against them alike."""
    prefills = tmp_path / "prefills"
    runs = []
    for i in range(2):
        out = tmp_path / f"rows{i}.json"
        assert bench.main(["--smoke", "--configs", "kvtier-int4-sparse", "--dtype", "float32",
                           "--prefill-cache", str(prefills), "--json", str(out)]) == 0
        runs.append({r["config"]: r for r in json.loads(out.read_text())})
    kept = list(prefills.iterdir())
    assert len(kept) == 1 and kept[0].suffix == ".safetensors" and kept[0].stat().st_mode & 0o077 == 0
    first, second = runs
    assert first["dynamic"]["prefill_kept"] and second["dynamic"]["prefill_kept"]
    assert not second["kvtier-int4-sparse"]["prefill_kept"]
    assert second["dynamic"]["prefill_s"] == first["dynamic"]["prefill_s"]  # the computed prefill's time
    assert second["dynamic"]["tokens"] == first["dynamic"]["tokens"]
    # kvtier's rows: the bench does not settle queued swap-outs between timed steps, so which
    # blocks a step reads back encoded follows the worker thread's timing (a rounding apart
    # under load); the prefill's token is the same, and all but at most one step's
    a, b = (r["kvtier-int4-sparse"]["tokens"] for r in (first, second))
    assert len(a) == len(b) and a[0] == b[0] and sum(x == y for x, y in zip(a, b)) >= len(a) - 1


def test_fill_from_prefill_fills_kvtier_from_the_kept_prefill(bench, tmp_path):
    """--fill-from-prefill: the kvtier row is filled from the kept prefill (one prefill in all)
    and decodes the tokens its own prefill gave, at a context four times its L1 budget (the
    sparse selection swaps blocks in every step); a --base child is told to do the same."""
    prefills = tmp_path / "prefills"
    rows = {}
    for fill in (False, True):
        out = tmp_path / f"rows-{fill}.json"
        assert bench.main(["--contexts", "512", "--steps", "6", "--warmup", "2", "--threads", "1",
                           "--block-tokens", "16", "--configs", "kvtier-int4-sparse", "--dtype", "float32",
                           "--prefill-cache", str(prefills), "--json", str(out)]
                          + (["--fill-from-prefill"] if fill else [])) == 0
        rows[fill] = {r["config"]: r for r in json.loads(out.read_text())}
    own, filled = rows[False]["kvtier-int4-sparse"], rows[True]["kvtier-int4-sparse"]
    assert not own["prefill_kept"] and filled["prefill_kept"]
    # the bench does not wait for queued swap-outs between steps (it times them): which blocks a
    # step reads back encoded follows the worker thread's timing, so a loaded machine may part
    # the two rows' logits by a rounding; the first token is the kept prefill's in both
    assert filled["tokens"][0] == own["tokens"][0]
    same = sum(a == b for a, b in zip(filled["tokens"], own["tokens"]))
    assert len(filled["tokens"]) == len(own["tokens"]) == 9 and same >= 8
    assert filled["bytes_per_token"] == pytest.approx(own["bytes_per_token"], rel=0.05)
    assert filled["swap_ins_per_layer_step"] > 0  # the selection ran over blocks outside L1
    args = bench.parse_args(["--base", "a4e1479", "--prefill-cache", str(prefills), "--fill-from-prefill"])
    assert bench.parse_args(bench.child_argv(args, 1024, str(tmp_path / "o.json"), None)[2:]).fill_from_prefill
    with pytest.raises(SystemExit, match="--fill-from-prefill needs --prefill-cache"):
        bench.parse_args(["--fill-from-prefill"])



def test_digest_rows_run_only_when_named_and_set_their_digest_tokens(bench, monkeypatch):
    from types import SimpleNamespace

    named = ("kvtier-int4-sparse-d1", "kvtier-int4-sparse-d2")
    assert not set(named) & set(bench.parse_args([]).configs)
    assert bench.parse_args(["--configs", *named]).configs == ["dynamic", *named]
    # the config each row's cache is built with (the cache itself stands in: no model here)
    monkeypatch.setattr(bench, "_kvtier_cache", lambda: SimpleNamespace(TieredCache=lambda cfg, model: cfg))
    model = SimpleNamespace(config=SimpleNamespace(head_dim=64, num_key_value_heads=3, num_hidden_layers=30))
    cfg = {n: bench.make_cache(n, model, 1024, 16, 0.25) for n in ("kvtier-int4-sparse", *named)}
    # the default row is KVTierConfig's default (a key row per token); -d2 the pair means
    assert [cfg[n].digest_tokens for n in ("kvtier-int4-sparse", *named)] == [1, 1, 2]
    assert {c.device_tokens for c in cfg.values()} == {256}


def test_repeat_rotates_the_order_and_reports_the_median_of_the_passes(bench, tmp_path, capsys):
    """--repeat: every configuration once per pass, each pass's ratio taken within the pass, the
    order rotated (a later pass may run the kvtier row before DynamicCache, fed the first pass's
    reference tokens), and the median printed."""
    out = tmp_path / "rows.json"
    assert bench.main(["--smoke", "--configs", "kvtier-int4-sparse", "--dtype", "float32", "--repeat", "3",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["repeat"], r["config"]) for r in rows] == [
        (0, "dynamic"), (0, "kvtier-int4-sparse"), (1, "kvtier-int4-sparse"), (1, "dynamic"),
        (2, "dynamic"), (2, "kvtier-int4-sparse")]
    by = {(r["repeat"], r["config"]): r for r in rows}
    for rep in range(3):
        dyn, kv = by[rep, "dynamic"], by[rep, "kvtier-int4-sparse"]
        assert kv["speed_x_dynamic"] == pytest.approx(kv["tokens_per_s"] / dyn["tokens_per_s"])
        assert dyn["tokens"] == by[0, "dynamic"]["tokens"]   # the reference decodes alike every pass
    med = sorted(by[rep, "kvtier-int4-sparse"]["speed_x_dynamic"] for rep in range(3))[1]
    assert f"kvtier-int4-sparse: {med:.2f}x [" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--repeat must be >= 1"):
        bench.parse_args(["--repeat", "0"])
    with pytest.raises(SystemExit, match="--repeat is for one tree"):
        bench.parse_args(["--base", "HEAD", "--repeat", "2"])
