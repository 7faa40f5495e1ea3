"""Named starting points for ``KVTierConfig``: ``KVTierConfig.preset(name, **overrides)``.

Each preset is a handful of fields over the defaults; every other field, and any of these, can
be overridden by keyword. What each costs and gives, with the measurements behind it, is in
docs/configuration.md ("Presets").
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["PRESETS", "PRESET_NAMES", "preset_fields"]

#: name -> (fields over the defaults, one line on what it is for)
PRESETS: dict[str, tuple[dict[str, Any], str]] = {
    "long-context": (
        {"attention": "sparse", "codec": "int4", "policy": "lru"},
        "contexts far past L1: each step attends the sink, the recent window and the blocks the query "
        "selects, recalled from whichever tier holds them (int4 below L1)",
    ),
    "offload": (
        {"attention": "dense", "codec": "int4", "policy": "lru"},
        "every token attended at every step; blocks outside L1 stored int4 and swapped in each step",
    ),
    "lossless": (
        {"attention": "dense", "codec": "fp32", "policy": "lru"},
        "every token attended, every tier exact: the same tokens as transformers' DynamicCache "
        "(pass dtype='bfloat16' or 'float16' for the 16-bit lossless codec at half the bytes)",
    ),
    "serve": (
        {"attention": "dense", "codec": "int8", "policy": "lru", "write_through": True},
        "many requests sharing prefixes: int8 blocks written through to L3/L4 as they seal, so a "
        "later request, a restarted process or another host reuses them",
    ),
}
PRESET_NAMES = tuple(PRESETS)


def preset_fields(name: str, overrides: dict[str, Any], lossless_codec: Callable[[str], str]) -> dict[str, Any]:
    """The fields of preset ``name`` with ``overrides`` over them (ValueError for an unknown name).
    ``lossless_codec``: the full-precision codec of a KV dtype name (the config's rule, handed in
    so that this table stays below the config it feeds)."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESET_NAMES)}; got {name!r}")
    fields = dict(PRESETS[name][0])
    if name == "lossless" and overrides.get("dtype") in ("bfloat16", "float16"):
        # a 16-bit KV is exact in its own 16-bit codec, at half fp32's bytes
        fields["codec"] = lossless_codec(overrides["dtype"])
    fields.update(overrides)
    return fields
