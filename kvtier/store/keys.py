"""Tier keys of stored blocks. Built in one place: another issue will switch them to
content-addressed keys (hash of fingerprint + token prefix) without touching the store."""
from __future__ import annotations


def block_key(seq: int, layer: int, block: int) -> str:
    """Key of block ``block`` of layer ``layer`` of sequence ``seq`` in every tier."""
    return f"{seq}/{layer}/{block}"
