"""Shared fixtures: one real model per dtype per test session (loading costs seconds once cached).

Torch runs single-threaded here: the CI and dev machines have 2 cores shared with other jobs, and
oversubscribed OpenMP threads made the model ~10x slower (measured: 2.0 s vs 21 s for the same
384-token prefill and 16 decode steps).
"""
from __future__ import annotations

import pytest
import torch

from kvtier.models import load_model, load_tokenizer


def _load(dtype):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return load_model(dtype=dtype, device="cpu")[0]


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="session")
def model():
    """SmolLM2-135M-Instruct in float32 on CPU. Tests must not change its settings for good."""
    return _load(torch.float32)


@pytest.fixture(scope="session")
def model_fp16():
    """float16 copy: with the ``fp16`` codec every tier is lossless."""
    return _load(torch.float16)


@pytest.fixture(scope="session")
def model_bf16():
    """bfloat16 copy: the fast dtype on these CPUs (prefill ~10x faster than fp16)."""
    return _load(torch.bfloat16)


@pytest.fixture
def restore_attention():
    """Models switched to kvtier attention by a test get their own back afterwards."""
    from kvtier.hf.cache import detach

    models = []
    yield models.append
    for m in models:
        detach(m)
