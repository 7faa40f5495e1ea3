"""Checks and bounds behind KVTierConfig's validation: field checkers that raise ValueError
naming the field and what is allowed, the marker of derived values, and this machine's memory.
Kept apart so config.py holds the fields and how they fit together."""
from __future__ import annotations

import os
from typing import Any

# Bounds that keep every size far from int64 overflow in the tiers' arithmetic; the real limits
# (the device's memory, the machine's RAM) are checked against them where they are known.
MAX_BYTES = 1 << 62
MAX_TOKENS = 1 << 31
MAX_SEQUENCES = 1 << 16
MIN_HOST_BYTES = 4096          # HostTier's smallest ring
MIN_SEGMENT_BYTES = 4096       # DiskTier: a segment header and one small record
MAX_SEGMENT_BYTES = (1 << 32) - 1  # DiskTier keeps record offsets in 32 bits
# Redis' default `databases 16` (Valkey's too): a db index above it is refused by the server
# at the first SELECT, which the L4 tier would only report as an unreachable server.
REDIS_DBS = 16


class Derived:
    """Marks a value the config computed, as opposed to one the user set (see ``__post_init__``)."""

    __slots__ = ()


class DerivedStr(Derived, str):
    __slots__ = ()


class DerivedInt(Derived, int):
    __slots__ = ()


def derive(cfg: Any, name: str, value: Any) -> None:
    """Set field ``name`` of the frozen dataclass ``cfg`` (a KVTierConfig in its ``__post_init__``)
    to ``value``, marked as derived."""
    object.__setattr__(cfg, name, DerivedStr(value) if isinstance(value, str) else DerivedInt(value))


def check_choice(name: str, value: Any, allowed: tuple) -> None:
    # of the allowed value's type too: 64.0 == 64, but a float group size is not a group size
    if isinstance(value, bool) or not any(isinstance(value, type(a)) and value == a for a in allowed):
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def check_int(name: str, value: Any, minimum: int, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an int >= {minimum} and <= {maximum:,}; got {value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")


def physical_memory() -> int | None:
    """Bytes of RAM of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory(device) -> int | None:
    """Bytes of memory of ``device`` (a torch.device): the GPU's total, the machine's RAM for CPU."""
    if device.type == "cuda":
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory
    return physical_memory() if device.type == "cpu" else None


def check_remote_url(url: Any) -> None:
    """``remote_url`` as kvtier's L4 tier and its client (Redis or Mooncake) will read it."""
    from kvtier.tiers.remote import check_url  # imports no client: the URL is parsed only
    from kvtier.tiers.remotes import is_mooncake

    if isinstance(url, str) and is_mooncake(url):
        from kvtier.tiers.mooncake import check_url as check_mooncake_url

        check_mooncake_url(url)  # its ValueError names remote_url and the form
        return
    try:
        check_url(url)
    except ValueError as e:
        raise ValueError(f"remote_url must be a Redis URL, a mooncake:// URL or None; {e}") from None
    try:
        from redis.connection import parse_url
    except ImportError:  # the L4 tier then reports itself unavailable; the form is checked above
        return
    try:
        kwargs = parse_url(url)
    except ValueError as e:
        raise ValueError(f"remote_url must be a URL the Redis client accepts; {e}") from None
    db = kwargs.get("db", 0)
    if isinstance(db, str):
        db = int(db) if db.isdigit() else -1
    if not 0 <= db < REDIS_DBS:
        raise ValueError(f"remote_url must name a db in [0, {REDIS_DBS - 1}] (Redis' default `databases "
                         f"{REDIS_DBS}`); got db {db}")
