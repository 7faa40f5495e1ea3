"""One CLI: sizes with suffixes everywhere, help and allowed values on every flag, one spelling of
each value across commands, --version, and no traceback for a user's mistake."""
import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import __version__
from kvtier.commands.cli import build_parser, main
from kvtier.config import CODECS
from kvtier.store.sizing import check_model

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
PLAN = ("plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16")


def _kvtier(*argv, **kw):
    return subprocess.run([sys.executable, "-m", "kvtier", *argv], capture_output=True, text=True, env=ENV, **kw)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flag(parser, name):
    return next(a for a in parser._actions if name in a.option_strings)


def test_generate_takes_size_suffixes_and_token_suffixes():
    from kvtier.commands import generate as chat

    p = argparse.ArgumentParser()
    chat.add_arguments(p)
    cfg = chat._config(p.parse_args(["--host-bytes", "256M", "--device-tokens", "1k", "--budget-tokens", "512"]), None)
    assert (cfg.host_bytes, cfg.device_tokens, cfg.budget_tokens) == (256 << 20, 1024, 512)


def test_plan_takes_token_suffixes(capsys):
    assert main([*PLAN, "--max-seq-len", "128k", "--avg-seq-len", "32k", "--json"]) == 0
    import json

    w = json.loads(capsys.readouterr().out)["workload"]
    assert (w["max_seq_len"], w["avg_seq_len"]) == (131072, 32768)


@pytest.mark.parametrize("bad", ["12x", "1.5", "0", "-4k"])
def test_a_bad_token_count_is_a_sentence(bad, capsys):
    with pytest.raises(SystemExit) as ei:
        main([*PLAN, f"--max-seq-len={bad}"])
    assert ei.value.code == 2 and "token count" in capsys.readouterr().err


def test_every_flag_of_every_command_has_help():
    for name, sub in _subparsers().items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"kvtier {name} {action.option_strings[0]} has no help"


def test_generate_choice_flags_list_their_values():
    gen = _subparsers()["generate"]
    text = gen.format_help()
    for flag, values in (("--codec", CODECS), ("--order", ("compress-then-tier", "tier-then-compress")),
                         ("--policy", ("lru", "sink-window", "h2o", "snapkv")), ("--attention", ("dense", "sparse"))):
        assert tuple(_flag(gen, flag).choices) == tuple(values)
        assert all(v in text for v in values)


def test_codecs_are_listed_one_way_in_every_command():
    subs = _subparsers()
    assert tuple(_flag(subs["plan"], "--codec").choices) == CODECS
    assert tuple(_flag(subs["generate"], "--codec").choices) == CODECS


def test_dtype_spellings_are_shared():
    subs = _subparsers()
    eval_dt, gen_dt = (set(_flag(subs[c], "--dtype").choices) for c in ("eval", "generate"))
    plan_dt = set(_flag(subs["plan"], "--dtype").choices)
    assert eval_dt == gen_dt
    assert plan_dt == eval_dt - {"auto"}  # plan sizes a KV dtype it is told; there is no machine to ask
    assert {"bf16", "bfloat16", "fp32", "float32"} <= plan_dt


def test_version(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0 and capsys.readouterr().out.strip() == f"kvtier {__version__}"


def test_cache_alone_prints_its_help(capsys):
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "usage: kvtier cache" in out and "clear" in out


def test_plan_refuses_ratio_with_hbm_bytes(capsys):
    assert main([*PLAN, "--max-seq-len", "8k", "--hbm-bytes", "40G", "--ratio", "4"]) == 2
    err = capsys.readouterr().err
    assert "--ratio and --hbm-bytes exclude each other" in err


def test_plan_json_into_a_closed_pipe_is_not_a_traceback():
    # `kvtier plan --json | head -1`: the reader exits after one line
    r = subprocess.run(f"{sys.executable} -m kvtier {' '.join(PLAN)} --max-seq-len 128k --json | head -1",
                       shell=True, capture_output=True, text=True, env=ENV)
    assert r.stdout.strip() == "{"
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


@pytest.mark.skipif(shutil.which("chattr") is None, reason="needs chattr (e2fsprogs) for an immutable directory")
def test_cache_clear_on_a_read_only_directory_is_a_sentence(tmp_path):
    from kvtier.tiers import DiskTier

    d = tmp_path / "l3"
    with DiskTier(d) as t:
        t.put("k", b"z" * 3000)
    # immutable: no file in it can be removed, by root either (a plain chmod does not stop root)
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem does not take the immutable flag")
    try:
        r = _kvtier("cache", "clear", str(d))
    finally:
        subprocess.run(["chattr", "-i", str(d)], check=True)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "cannot" in r.stderr and str(d) in r.stderr


def test_plan_recommends_sparse_for_a_long_context_with_a_config_attach_accepts(capsys):
    import json

    from kvtier.config import KVTierConfig

    assert main([*PLAN, "--max-seq-len", "128k", "--concurrency", "4", "--json"]) == 0
    sp = json.loads(capsys.readouterr().out)["sparse"]
    assert sp["recommended"] and sp["device_tokens"] == int(131072 * 0.03) // 16 * 16
    fields = dict(sp["config"])
    cfg = KVTierConfig.preset(fields.pop("preset"), **fields)
    assert cfg.attention == "sparse" and cfg.device_tokens == sp["device_tokens"]
    check_model(cfg, 32, 8, 128, __import__("torch").bfloat16, machine=False)
    # the digests' L1 cost is stated: an int4 key row per token (half a byte a channel, a float16
    # scale and zero per channel and 16-token block) and an int8 value mean per 4 with its float32 scale
    assert sp["digest_bytes_per_token"] == 32 * 8 * (128 / 2 + 4 * 128 / 16 + (128 + 4) / 4)
    assert sp["value_digest_tokens"] == 4
    assert main([*PLAN, "--max-seq-len", "128k", "--concurrency", "4"]) == 0
    text = capsys.readouterr().out
    assert "sparse     recommended" in text and "= KV + digests" in text and "KVTierConfig.preset('long-context'" in text


def test_plans_digest_bytes_are_what_a_store_holds():
    # the plan's per-token digest figure against a real store's digest table after a prefill
    import torch

    from kvtier import plan
    from kvtier.config import KVTierConfig
    from kvtier.store import KVStore

    layers, kvh, hd, tokens = 2, 2, 64, 16 * 40
    p = plan.make_plan(layers, kvh, hd, "bfloat16", 1, tokens, tokens, "int4")
    cfg = KVTierConfig.preset("long-context", device_tokens=128, host_bytes=8 << 20)
    store = KVStore(cfg, num_layers=layers, kv_heads=kvh, head_dim=hd, dtype=torch.bfloat16,
                    device=torch.device("cpu"))
    try:
        seq = store.add_sequence()
        for layer in range(layers):
            kv = torch.randn(kvh, tokens + 1, hd).to(torch.bfloat16)  # +1: the last full block seals
            store.append(seq, layer, kv, kv)
        st = store.stats()
        sealed_tokens = tokens  # every block but the open one
        assert st["digest_bytes"] == p["sparse"]["digest_bytes_per_token"] * sealed_tokens
    finally:
        store.close()
