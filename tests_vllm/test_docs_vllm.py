"""The vLLM examples of the README and docs/vllm.md run as written on a real engine (the model
path and the L3 directory pointed at this test's)."""
from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("doc", ["README.md", "docs/vllm.md"])
def test_vllm_example_runs(doc, model_dir, tmp_path, monkeypatch):
    code = next(c for c in re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S) if "from vllm" in c)
    code = (code.replace('"/path/to/model"', repr(model_dir)).replace('"/var/cache/kvtier"', repr(str(tmp_path / "l3")))
            .replace('remote_url="redis://127.0.0.1:6379/0"', "remote_url=None")
            .replace("max_tokens=64", "max_tokens=4"))
    code = code.replace("LLM(model=", "LLM(enforce_eager=True, enable_prefix_caching=False, model=")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, doc, "exec"), scope)
    assert "kvtier" in (scope["out"][0].kv_transfer_params or {})
    del scope
    gc.collect()
