"""The vLLM examples of the README and docs/vllm.md run as written on a real engine: the model
path, the L3 directory and the Redis URL pointed at this test's, and the engine settings every
test here uses (float32 is already what the examples say)."""
from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("doc", ["README.md", "docs/vllm.md"])
def test_vllm_example_runs(doc, model_dir, redis_module, tmp_path, monkeypatch):
    code = next(c for c in re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S) if "from vllm" in c)
    assert '"/path/to/model"' in code and '"/var/cache/kvtier"' in code
    code = (code.replace('"/path/to/model"', repr(model_dir))
            .replace('"/var/cache/kvtier"', repr(str(tmp_path / "l3")))
            .replace('"redis://127.0.0.1:6379/0"', repr(redis_module.url))
            .replace("max_tokens=64", "max_tokens=4")
            .replace("LLM(model=", "LLM(enforce_eager=True, max_model_len=2048, enable_prefix_caching=False, model="))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    try:
        exec(compile(code, doc, "exec"), scope)
        assert "kvtier" in (scope["out"][0].kv_transfer_params or {})
    finally:
        if "llm" in scope:
            scope["llm"].llm_engine.engine_core.shutdown()
        scope.clear()
        gc.collect()
