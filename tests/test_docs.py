"""The README and docs/ as a newcomer meets them: every Python example runs as written (the
README's quickstart twice in one process, as a notebook cell run again), and the configuration
reference is what tools/config_doc.py makes of the field docstrings today."""
from __future__ import annotations

import gc
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def _needs_vllm(code: str) -> bool:
    return "from vllm" in code or "import vllm" in code


EXAMPLES = [pytest.param(p, i, id=f"{p.relative_to(ROOT)}#{i}")
            for p in DOCS for i, code in enumerate(python_blocks(p)) if not _needs_vllm(code)]


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    quick = text.split("## Quickstart: transformers", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    # at most two settings: a preset and a path
    assert re.search(r'KVTierConfig\.preset\("long-context", disk_path="kvtier-cache"\)', quick)
    assert "pip install" in text and "make demo" in text and "make test" in text
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).exists(), link


def test_every_vllm_example_is_run_by_the_vllm_suite():
    # the vLLM blocks cannot run here (no vllm in this venv): tests_vllm/test_docs_vllm.py runs them
    vllm_blocks = [p.name for p in DOCS for c in python_blocks(p) if _needs_vllm(c)]
    assert sorted(vllm_blocks) == ["README.md", "vllm.md"]


@pytest.mark.slow
@pytest.mark.parametrize("path, index", EXAMPLES)
def test_example_runs_as_written(path, index, monkeypatch, tmp_path):
    from kvtier.integrations import registry

    code = python_blocks(path)[index]
    monkeypatch.chdir(tmp_path)  # their disk_path and files are relative
    code = code.replace("max_new_tokens=64", "max_new_tokens=8")  # the speed is not what is tested
    runs = 2 if path.name == "README.md" else 1  # the quickstart copied verbatim, run again in one process
    for _ in range(runs):
        exec(compile(code, str(path.relative_to(ROOT)), "exec"), {})
    gc.collect()
    assert not any(s.cfg.disk_path == "kvtier-cache" for s in registry.open_stores())


def test_configuration_reference_is_generated_from_the_docstrings():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "config_doc.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_every_preset_is_documented():
    from kvtier.presets import PRESET_NAMES

    text = (ROOT / "docs" / "configuration.md").read_text()
    for name in PRESET_NAMES:
        assert f"| `{name}` |" in text, name
