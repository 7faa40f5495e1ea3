"""The README and docs/ as a newcomer meets them: every Python example runs as written (the
README's quickstart twice in one process, as a notebook cell run again), and the configuration
reference is what tools/config_doc.py makes of the field docstrings today."""
from __future__ import annotations

import dataclasses
import functools
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


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> set[str]:
    out, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = _slug(m.group(1))
            # a repeated heading gets -1, -2, ... as on GitHub
            out.add(f"{s}-{seen[s]}" if s in seen else s)
            seen[s] = seen.get(s, 0) + 1
    return out


def test_every_relative_link_of_the_docs_reaches_its_file_and_heading():
    # the results pages link to one another's dated sections: a renamed heading breaks them silently
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = page.parent / path if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_every_vllm_example_is_run_by_the_vllm_suite():
    # the vLLM blocks cannot run here (no vllm in this venv): tests_vllm/test_docs_vllm.py runs them
    vllm_blocks = [p.name for p in DOCS for c in python_blocks(p) if _needs_vllm(c)]
    assert sorted(vllm_blocks) == ["README.md", "vllm.md"]


@pytest.mark.slow
@pytest.mark.parametrize("path, index", EXAMPLES)
def test_example_runs_as_written(path, index, monkeypatch, tmp_path):
    from kvtier.hf import registry

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


# A figure in a field docstring goes stale when a default or the code moves: intervals, signed or
# decimal percentages, ratios ("1.06x"), throughput, perplexity deltas, dates, bench names, byte
# counts written with thousands separators, timings. "the best setting measured" with a link is fine.
MEASUREMENT = re.compile(
    r"±|\bCI\b|\[[-+]?\d+\.\d+, [-+]?\d|tok/s|Δ|\bppl\b|\b\d+(\.\d+)?x\b|[-+]\d+(\.\d+)?%|\b\d+\.\d+%"
    r"|\b\d\.\d{2,}\b|\b\d{4}-\d{2}-\d{2}\b|\bbench_\w+|\b\d{1,3}(,\d{3})+\b|\d+ ?[kKM]B\b|\d ?(us|ms)\b")


def _field_docs():
    from kvtier.configdoc import field_docs

    return field_docs((ROOT / "kvtier" / "config.py").read_text(), "KVTierConfig")


def test_help_shows_every_field_description():
    import pydoc

    from kvtier import KVTierConfig

    text = pydoc.render_doc(KVTierConfig, renderer=pydoc.plaintext)
    docs = _field_docs()
    assert len(docs) == len(dataclasses.fields(KVTierConfig))
    for f in docs:
        assert f.doc, f"{f.name} has no docstring"
        assert f.doc.splitlines()[0] in text, f.name


def test_field_docstrings_say_what_a_field_means_not_what_it_measured():
    for f in _field_docs():
        assert len(f.doc.splitlines()) <= 5, f"{f.name}: {len(f.doc.splitlines())} lines (at most 5)"
        hit = MEASUREMENT.search(f.doc)
        assert hit is None, f"{f.name} carries a measurement ({hit.group()!r}): move it to docs/results/"


def test_measurement_pattern_flags_figures_and_spares_meanings():
    assert MEASUREMENT.search("Δppl +2.8 / +2.2%")
    assert MEASUREMENT.search("0.87 [0.79, 0.95]")
    assert MEASUREMENT.search("cost 1.06x what 4-token bf16 ones did")
    assert MEASUREMENT.search("a plain int2 block takes 4,320 bytes per token")
    assert MEASUREMENT.search("~10 us more per swap-in")
    assert not MEASUREMENT.search("Size of one L3 segment file, in [4096, 2**32); 64 MiB by default")
    assert not MEASUREMENT.search("fraction (by rank, in [0, 1]); the best setting measured")


def test_every_measurement_link_of_a_docstring_has_its_section():
    text = (ROOT / "docs" / "results" / "config-defaults.md").read_text()
    sections = set(re.findall(r"^## `(\w+)`", text, re.M))
    for f in _field_docs():
        for anchor in re.findall(r"config-defaults\.md#(\w+)", f.doc):
            assert anchor in sections, (f.name, anchor)
