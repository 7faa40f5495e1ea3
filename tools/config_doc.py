"""Write the field reference of docs/configuration.md from KVTierConfig's field docstrings.

The docstrings in kvtier/config.py are the one source; this copies them, with each field's type
and default, between the markers of docs/configuration.md, the fields a user sets first and the
research settings last ("Advanced"). tests/test_docs.py fails when the file is stale:

    python tools/config_doc.py            # rewrite docs/configuration.md
    python tools/config_doc.py --check    # exit 1 when it is stale
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: this checkout's kvtier

from kvtier.configdoc import field_docs  # noqa: E402  (the parser help(KVTierConfig) uses too)

CONFIG = ROOT / "kvtier" / "config.py"
DOC = ROOT / "docs" / "configuration.md"
BEGIN, END = "<!-- fields:begin (tools/config_doc.py) -->", "<!-- fields:end -->"

#: settings the studies behind the defaults tune; most users never set them
ADVANCED = {
    "precision", "heavy_codec", "cold_codec", "heavy_fraction", "cold_fraction", "cold_key_outliers",
    "recall_mass", "recall_reference", "key_axis", "value_axis", "int2_key_outliers", "int8_zero_point",
    "int8_value_axis", "snapkv_observe_steps", "high_watermark", "low_watermark", "evict_batch_blocks",
    "select_score", "digest_tokens", "digest_dtype", "value_digest_tokens", "attention_math", "prefetch", "prefetch_blocks",
    "byte_stage_min_saving", "byte_stage_l2", "host_overflow_bytes", "group_size",
}


def fields() -> list[tuple[str, str, str, str]]:
    """(name, type, default, docstring) of every KVTierConfig field, in source order."""
    return field_docs(CONFIG.read_text(), "KVTierConfig")


def _entry(name: str, typ: str, default: str, doc: str) -> str:
    text = " ".join(line.strip() for line in doc.splitlines())
    return f"- **`{name}`** (`{typ}`, default `{default}`): {text}"


def render() -> str:
    rows = fields()
    main = [_entry(*r) for r in rows if r[0] not in ADVANCED]
    adv = [_entry(*r) for r in rows if r[0] in ADVANCED]
    return "\n".join([BEGIN, "", "### Fields", "", *main, "", "### Advanced", "",
                      "Research settings: the defaults are what the studies in [results/](results/) measured best; "
                      "why each: [results/config-defaults.md](results/config-defaults.md).", "",
                      "See also [Details](#details) below.",
                      "", *adv, "", END])


def updated(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + render() + tail


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    new = updated(text)
    if "--check" in argv:
        if new != text:
            print(f"{DOC} is stale: run python tools/config_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
