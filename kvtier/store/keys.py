"""Process-local tier keys of blocks whose token ids are not known.

A block gets one of these when its entry is created; once sealed with known token ids it moves
to a content-addressed key (``prefix.block_key``). Process-local keys are wiped from L3 when a
store opens it, since no later process can address them."""
from __future__ import annotations


def block_key(seq: int, layer: int, block: int) -> str:
    """Key of block ``block`` of layer ``layer`` of sequence ``seq`` in every tier."""
    return f"{seq}/{layer}/{block}"
