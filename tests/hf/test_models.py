"""The real model, text and KV capture that every other test and benchmark relies on."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from kvtier.models import (
    capture_kv,
    find_gguf,
    load_model,
    load_text,
    model_fingerprint,
    text_ids,
)


def test_load_text_is_stable_and_long():
    text = load_text()
    assert text == load_text()
    assert len(text) > 400_000
    assert "assert" in text


def test_model_shape(model):
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.num_hidden_layers == 30
    assert cfg.num_key_value_heads == 3
    assert cfg.num_attention_heads == 9
    assert cfg.head_dim == 64
    assert next(model.parameters()).dtype == torch.float32
    assert not model.training


def test_text_ids(tokenizer):
    ids = text_ids(tokenizer, 64, offset=10)
    assert ids.shape == (1, 64)
    assert torch.equal(ids[0, 5:], text_ids(tokenizer, 59, offset=15)[0])
    with pytest.raises(ValueError, match="n_tokens"):
        text_ids(tokenizer, 0)
    with pytest.raises(ValueError, match="offset"):
        text_ids(tokenizer, 10, offset=10**9)


def test_capture_kv_shapes_and_consistency(model, tokenizer):
    kv = capture_kv(model, tokenizer, 48, offset=100)
    assert len(kv) == 30
    for k, v in kv:
        assert k.shape == (3, 48, 64) and v.shape == (3, 48, 64)
        assert k.dtype == torch.float32
        assert torch.isfinite(k).all() and torch.isfinite(v).all()
    # Causality: the KV of a prefix does not depend on what follows it.
    kv_prefix = capture_kv(model, tokenizer, 16, offset=100)
    for (k, v), (kp, vp) in zip(kv, kv_prefix):
        torch.testing.assert_close(k[:, :16], kp, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v[:, :16], vp, rtol=1e-4, atol=1e-4)
    # Different text gives different KV (nothing is a constant).
    other = capture_kv(model, tokenizer, 16, offset=5000)
    assert not torch.allclose(other[3][0], kv_prefix[3][0])


def test_model_is_fluent_on_its_text(model, tokenizer):
    # Next-token accuracy on real documentation text: a working model gets far above chance.
    ids = text_ids(tokenizer, 256, offset=2000)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    acc = (logits[0, :-1].argmax(-1) == ids[0, 1:]).float().mean().item()
    assert acc > 0.35, acc


def test_fingerprint_is_stable_and_discriminates(model):
    fp = model_fingerprint(model)
    assert fp == model_fingerprint(model)
    assert fp.startswith("llama-")
    other = type(model.config).from_dict({**model.config.to_dict(), "num_hidden_layers": 2})
    from transformers import AutoModelForCausalLM

    small = AutoModelForCausalLM.from_config(other)
    assert model_fingerprint(small) != fp


def test_load_model_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="path"):
        load_model(path=tmp_path / "missing")
    with pytest.raises(ValueError, match="dtype"):
        load_model(dtype=torch.int8)


def test_load_model_from_local_directory(tmp_path, model, tokenizer):
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "m")
    m2, tok2 = load_model(path=tmp_path / "m", dtype=torch.float16)
    assert next(m2.parameters()).dtype == torch.float16
    # the identity names the weights as loaded: the same checkpoint in another dtype computes
    # other K/V bits, in the same dtype the same ones (whatever the file format)
    assert model_fingerprint(m2) != model_fingerprint(model)
    m3, _ = load_model(path=tmp_path / "m", dtype=next(model.parameters()).dtype)
    assert model_fingerprint(m3) == model_fingerprint(model)
    assert tok2("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]


@pytest.mark.slow
def test_first_load_converts_gguf_and_caches(tmp_path, model):
    cache_root = tmp_path / "cache"
    m, tok = load_model(cache_dir=cache_root)
    target = cache_root / "smollm2-135m-instruct"
    assert (target / "model.safetensors").is_file()
    assert not list(target.glob("*.bin")) and not list(target.glob("*.pt"))  # no pickle
    for p in [cache_root, *target.rglob("*")]:
        mode = stat.S_IMODE(os.stat(p).st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))
    # The converted copy computes exactly what the directly converted GGUF computes.
    from transformers import AutoModelForCausalLM

    gguf = find_gguf()
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    ids = text_ids(tok, 32)
    with torch.inference_mode():
        assert torch.equal(direct(input_ids=ids).logits, m(input_ids=ids).logits)
    assert model_fingerprint(direct) == model_fingerprint(m) == model_fingerprint(model)
    # A .gguf path is accepted too and cached under its own name.
    m3, _ = load_model(path=gguf, cache_dir=cache_root)
    assert model_fingerprint(m3) == model_fingerprint(model)
