"""Shared fixtures: one real model per test session (loading it costs seconds once cached)."""
from __future__ import annotations

import pytest
import torch

from kvtier.integrations.model import load_model


@pytest.fixture(scope="session")
def model_and_tokenizer():
    """SmolLM2-135M-Instruct in float32 on CPU, shared by every integration test.

    Tests must not change the model's settings (attention implementation, dtype) without
    restoring them.
    """
    torch.manual_seed(0)
    return load_model(dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def model(model_and_tokenizer):
    return model_and_tokenizer[0]


@pytest.fixture(scope="session")
def tokenizer(model_and_tokenizer):
    return model_and_tokenizer[1]
