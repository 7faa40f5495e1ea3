"""`kvtier eval --fidelity`: every configuration replays the reference's RULER answer on a fresh
cache, and its log-probs are compared with the reference's step by step."""
from __future__ import annotations

import json

import pytest
import torch

from kvtier.eval import extract, metrics
from kvtier.eval.caches import CacheSpec, Run, prefill
from kvtier.eval.runner import run_all

KV = {"attention": "sparse", "block_tokens": 16, "host_bytes": 1 << 22, "policy": "lru", "write_through": False}


@pytest.fixture(scope="module")
def sample(tokenizer):
    return extract.generate("extract_digits", tokenizer, 512, 1, seed=3)[0]


@torch.inference_mode()
def test_replay_follows_the_reference_and_orders_the_codecs(model_bf16, tokenizer, tmp_path, sample):
    specs = [CacheSpec("ref", "dynamic", {}), CacheSpec("same", "dynamic", {}),
             CacheSpec("int8", "kvtier", {**KV, "codec": "int8", "device_tokens": 256}),
             CacheSpec("int2", "kvtier", {**KV, "codec": "int2", "device_tokens": 64})]
    ref, same, int8, int2 = run_all(model_bf16, specs, sample, tmp_path, tokenizer=tokenizer, fidelity=True)
    n = len(ref.tokens)
    assert n >= 2 and ref.fidelity is None and ref.logp is None   # the reference's own log-probs are not kept
    # the same computation replayed: the same distributions at every step
    assert same.fidelity == {"kl": 0.0, "top1": 1.0, "steps": n}
    assert same.tokens == ref.tokens
    for r in (int8, int2):
        assert r.fidelity["steps"] == n and r.fidelity["kl"] >= 0.0 and 0.0 <= r.fidelity["top1"] <= 1.0
        # until its greedy answer leaves the reference's, a row's replay is its own greedy decode
        agree = next((i for i, (a, b) in enumerate(zip(r.tokens, ref.tokens)) if a != b), min(len(r.tokens), n))
        assert r.fidelity["top1"] * n >= agree - 1e-9
        assert len(r.step_s) == len(r.tokens) - 1                  # speed counts the greedy decode only
    # more bits and a larger L1 stay closer to the reference than int2 in a quarter of it
    assert int8.fidelity["kl"] < int2.fidelity["kl"]


@torch.inference_mode()
def test_the_figures_are_the_replays_own(model_bf16, tokenizer, tmp_path, sample):
    """The replay is the row's configuration fed the reference's tokens: recomputed here by hand."""
    spec = CacheSpec("int4", "kvtier", {**KV, "codec": "int4", "device_tokens": 64})
    ref, got = run_all(model_bf16, [CacheSpec("ref", "dynamic", {}), spec], sample, tmp_path,
                       tokenizer=tokenizer, fidelity=True)
    ids = sample.input_ids
    pre = prefill(model_bf16, ids)
    logits = []
    for cache_spec in (CacheSpec("ref", "dynamic", {}), spec):
        run = Run(cache_spec, model_bf16, pre, ids.numel(), tmp_path)
        try:
            out = [pre.logits]
            for t, tok in enumerate(ref.tokens[:-1]):
                run.settle()
                o = model_bf16(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[ids.numel() + t]]),
                               cache=run.cache, use_cache=True)
                out.append(o.logits[0, -1].float())
            logits.append(torch.log_softmax(torch.stack(out), dim=-1))
        finally:
            run.close()
    assert logits[0].argmax(-1).tolist() == ref.tokens
    assert got.fidelity["kl"] == pytest.approx(metrics.kl_divergence(logits[0], logits[1]).mean().item(), rel=1e-6)
    assert got.fidelity["top1"] == metrics.top1_agreement(logits[0], logits[1])


def test_eval_reports_fidelity_with_intervals(tmp_path):
    from kvtier.commands.cli import main

    out = tmp_path / "out"
    argv = ["eval", "--suite", "ruler", "--tasks", "extract_digits", "--contexts", "512", "--samples", "2",
            "--only", "kvtier int4 sparse L1=12.5%", "--threads", "1", "--fidelity", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "eval.json").read_text())
    assert doc["settings"]["fidelity"] is True
    ref, row = doc["results"]
    assert "fidelity_kl" not in ref["accuracy"]
    acc = row["accuracy"]
    per = [s["fidelity"] for s in acc["samples"]]
    assert len(per) == 2 and acc["fidelity_steps"] == sum(f["steps"] for f in per)
    assert acc["fidelity_kl"] == pytest.approx(sum(f["kl"] for f in per) / 2)
    assert acc["ci"]["fidelity_kl"]["lo"] <= acc["fidelity_kl"] <= acc["ci"]["fidelity_kl"]["hi"]
    assert acc["ci"]["fidelity_top1"]["n"] == 2
    md = (out / "eval.md").read_text()
    assert "KL to ref [95% CI]" in md and "top-1 to ref %" in md



@torch.inference_mode()
def test_a_row_that_answers_as_the_reference_is_not_replayed(model_bf16, tokenizer, tmp_path, sample, monkeypatch):
    """Its greedy decode fed the reference's tokens already: its own log-probs are the replay's,
    so only rows whose answer differs are replayed, and the figures are those of a replay."""
    from kvtier.eval import runner

    fed = []
    real = runner._teacher_forced
    monkeypatch.setattr(runner, "_teacher_forced", lambda *a, **k: fed.append(1) or real(*a, **k))
    specs = [CacheSpec("ref", "dynamic", {}), CacheSpec("same", "dynamic", {}),
             CacheSpec("int8", "kvtier", {**KV, "codec": "int8", "device_tokens": 256}),
             CacheSpec("int2", "kvtier", {**KV, "codec": "int2", "device_tokens": 32})]
    rows = run_all(model_bf16, specs, sample, tmp_path, tokenizer=tokenizer, fidelity=True)
    ref = rows[0]
    differ = [r for r in rows[1:] if r.tokens != ref.tokens]
    agree = [r for r in rows[1:] if r.tokens == ref.tokens]
    assert differ and len(fed) == len(differ) and len(agree) >= 2 and all(r.logp is None for r in rows)
    # an agreeing kvtier row's figures equal a replay computed anyway
    row = next(r for r in agree if r.spec.kind == "kvtier")
    pre = prefill(model_bf16, sample.input_ids)
    ref_logp = runner._run_one(model_bf16, specs[0], sample, sample.input_ids, pre, tmp_path, tokenizer, None,
                               keep_logp=True).logp
    replay = runner._run_one(model_bf16, row.spec, sample, sample.input_ids, pre, tmp_path, tokenizer, None,
                             along=ref.tokens).logp
    assert torch.equal(ref_logp.argmax(-1), torch.tensor(ref.tokens))
    assert row.fidelity == {"kl": metrics.kl_divergence(ref_logp, replay).mean().item(),
                            "top1": metrics.top1_accuracy(replay, torch.tensor(ref.tokens)), "steps": len(ref.tokens)}
