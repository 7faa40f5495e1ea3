"""Argument types every ``kvtier`` command shares, so one value is spelled one way everywhere.

Sizes take binary suffixes (``256M``, ``40G``, ``1.5T``, ``4096``), token counts ``k``/``m``
(``128k`` = 131,072 tokens), and choices come from the config's own ``Literal`` types, so a
flag's allowed values are the field's.
"""
from __future__ import annotations

import argparse
from fractions import Fraction
from typing import get_args

__all__ = ["choices_of", "size", "token_count", "token_list"]

_BYTE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_TOKEN_UNITS = {"k": 1 << 10, "m": 1 << 20}


def _scaled(text: str, units: dict[str, int]) -> Fraction:
    t = text.strip().lower()
    unit = units.get(t[-1:], 1)
    return Fraction(t[:-1] if t[-1:] in units else t) * unit


def size(text: str) -> int:
    """A byte count like ``40G``, ``512M``, ``256MiB``, ``1.5T`` or ``123456`` (binary units), exactly."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        n = _scaled(t, _BYTE_UNITS)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"a size like 40G, 256M or 4096, got {text!r}") from None
    if n < 1 or n.denominator != 1 and n < 1 << 10 or n > 1 << 62:
        raise argparse.ArgumentTypeError(f"a size between 1 byte and 4 EiB, got {text!r}")
    return int(n)


def token_count(text: str) -> int:
    """A token count like ``128k`` (131,072), ``8192`` or ``1m`` (binary k/m), a whole number >= 1."""
    try:
        n = _scaled(text, _TOKEN_UNITS)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"a token count like 8192 or 128k, got {text!r}") from None
    if n < 1 or n.denominator != 1:
        raise argparse.ArgumentTypeError(f"a whole token count >= 1 like 8192 or 128k, got {text!r}")
    return int(n)


def token_list(text: str) -> list[int]:
    """Comma-separated token counts (``8k,16k,32768``)."""
    vals = [token_count(x) for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"one or more token counts like 8k,16k, got {text!r}")
    return vals


def choices_of(literal) -> tuple[str, ...]:
    """The allowed values of a config ``Literal`` type, for ``choices=``."""
    return tuple(get_args(literal))
