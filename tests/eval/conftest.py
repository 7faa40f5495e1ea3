"""The embedded SmolLM2 model and tokenizer, once per session (single-threaded: see
tests/hf/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from kvtier.models import load_model, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="session")
def model_bf16():
    torch.set_num_threads(1)
    return load_model(dtype=torch.bfloat16)[0]
