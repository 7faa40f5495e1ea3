"""Checks and bounds behind KVTierConfig's validation: what each field allows on its own,
declared as tables (a ``Literal`` or ``bool`` annotation is its own table) and checked by one
function, :func:`check_fields`, with a ValueError naming the field and what is allowed; the
marker of derived values; this machine's memory. Kept apart so config.py holds the fields and
how they fit together."""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import tomllib
import types
import typing
import warnings
from typing import Any, Callable, Literal, get_args, get_origin

# Bounds that keep every size far from int64 overflow in the tiers' arithmetic; the real limits
# (the device's memory, the machine's RAM) are checked against them where they are known.
MAX_BYTES = 1 << 62
MAX_TOKENS = 1 << 31
MAX_SEQUENCES = 1 << 16
MIN_HOST_BYTES = 4096          # HostTier's smallest ring
MIN_SEGMENT_BYTES = 4096       # DiskTier: a segment header and one small record
MAX_SEGMENT_BYTES = (1 << 32) - 1  # DiskTier keeps record offsets in 32 bits
#: ``int2_key_outliers`` at most (``kvtier.compress.codecs.MAX_OUTLIERS``)
MAX_KEY_OUTLIERS = 32
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


def plain(v: Any) -> Any:
    """A derived value as the plain str/int it stands for."""
    if isinstance(v, DerivedStr):
        return str(v)
    if isinstance(v, DerivedInt):
        return int(v)
    return v


def check_whole_blocks(cfg: Any, name: str, tokens: int, bt: int) -> None:
    """``tokens`` is a whole number of ``bt``-token blocks: the store keeps, evicts and attends
    whole blocks, so any other count would be rounded to a size the user did not ask for."""
    if tokens % bt == 0:
        return
    low, high = tokens // bt * bt, (tokens // bt + 1) * bt
    nearest = f"{low:,} or {high:,}" if low > 0 or name in ("sink_tokens", "window_tokens") else f"{high:,}"
    why = f", the default for {cfg.attention} attention" if isinstance(cfg.block_tokens, Derived) else ""
    raise ValueError(f"{name} must be a whole number of blocks (block_tokens={bt}{why}): {nearest}; "
                     f"got {tokens:,}")


def read_toml(path: Any) -> dict:
    """The fields in TOML file ``path``: at top level or under a ``[kvtier]`` table. A missing,
    unreadable or malformed file raises ValueError naming it."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ValueError(f"config file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"config file {str(path)!r} cannot be read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    if "kvtier" in data and isinstance(data["kvtier"], dict):
        data = data["kvtier"]
    return data


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
        from kvtier.tiers.mooncake_url import check_url as check_mooncake_url

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


#: Old field name -> its name now. The old names are accepted (with a DeprecationWarning naming
#: the new field) for one release, wherever a config is built from names: keyword arguments,
#: ``dataclasses.replace``, presets' overrides, ``from_dict``/``from_toml``, CLI flags.
RENAMED_FIELDS = {
    "hot_tokens": "device_tokens", "hot_bytes": "device_bytes", "hot_max_bytes": "device_max_bytes",
    "lz4_min_saving": "byte_stage_min_saving",
}


def renamed_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with each old field name of ``RENAMED_FIELDS`` replaced by its new one, with a
    DeprecationWarning pointing at the user's code (the first caller outside kvtier and
    dataclasses). An old name given beside its new one wins: ``dataclasses.replace(cfg,
    hot_tokens=...)`` passes every current field along with the change."""
    if not RENAMED_FIELDS.keys() & fields.keys():
        return fields
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    out = dict(fields)
    for old, new in RENAMED_FIELDS.items():
        if old in out:
            warnings.warn(f"KVTierConfig field {old!r} is renamed {new!r}; the old name will stop "
                          f"working in the next release", DeprecationWarning, stacklevel=level)
            out[new] = out.pop(old)
    return out


_INTERNAL = (os.path.dirname(os.path.abspath(__file__)), os.path.abspath(dataclasses.__file__))


#: Codec names known to ``kvtier.compress.get_codec`` (kept here so a config is checked before
#: any codec module is imported).
CODECS = ("fp16", "bf16", "fp32", "int8", "int4", "int2", "nf4", "fp4", "dyn8")
#: The integer codecs ``precision="importance"`` chooses among, from most to fewest bits.
PRECISION_CODECS = ("int8", "int4", "int2")
#: Quantization group sizes the codecs implement.
GROUP_SIZES = (32, 64, 128)

# -- what each field allows on its own. Fields annotated with a ``Literal`` (or ``bool``) are
# checked against its values without an entry here; ``Optional`` lets None pass. What depends on
# other fields (whole blocks, budgets, codec bit orders) is checked in KVTierConfig.__post_init__.

#: field -> allowed values, for fields whose annotation does not list them
CHOICES: dict[str, tuple] = {
    "codec": CODECS, "host_codec": CODECS, "disk_codec": CODECS,
    # a role's own codec: the 16-bit pass-through ones follow the KV dtype, so only codec names them
    "key_codec": tuple(c for c in CODECS if c not in ("fp16", "bf16")),
    "value_codec": tuple(c for c in CODECS if c not in ("fp16", "bf16")),
    "heavy_codec": PRECISION_CODECS, "cold_codec": PRECISION_CODECS, "group_size": GROUP_SIZES,
}
#: integer field -> (minimum, maximum)
RANGES: dict[str, tuple[int, int]] = {
    "block_tokens": (1, MAX_TOKENS), "device_bytes": (1, MAX_BYTES), "max_sequences": (1, MAX_SEQUENCES),
    "device_max_bytes": (1, MAX_BYTES), "host_bytes": (MIN_HOST_BYTES, MAX_BYTES),
    "host_overflow_bytes": (0, MAX_BYTES), "disk_bytes": (1, MAX_BYTES),
    "disk_segment_bytes": (MIN_SEGMENT_BYTES, MAX_SEGMENT_BYTES), "disk_kept_bytes": (0, MAX_BYTES),
    "cold_key_outliers": (0, MAX_KEY_OUTLIERS), "int2_key_outliers": (0, MAX_KEY_OUTLIERS),
    "budget_tokens": (1, MAX_TOKENS), "sink_tokens": (0, MAX_TOKENS), "window_tokens": (0, MAX_TOKENS),
    "snapkv_observe_steps": (1, 1 << 20), "evict_batch_blocks": (1, 1 << 20), "prefetch_blocks": (1, 1 << 24),
}
#: why a too small value is refused, where the bound alone does not say
RANGE_WHY = {"host_bytes": "the smallest L2 ring; it must also hold one block of the model, checked at attach"}
#: number field (int or float, never bool) -> (test, what the message says is allowed)
NUMBERS: dict[str, tuple[Callable[[float], bool], str]] = {
    "disk_max_age_s": (lambda v: v >= 0, "a number of seconds >= 0 or None"),
    "heavy_fraction": (lambda v: 0 <= v <= 1, "a float in [0, 1]"),
    "cold_fraction": (lambda v: 0 <= v <= 1, "a float in [0, 1]"),
    "recall_mass": (lambda v: v > 0, "a number > 0 (math.inf: never)"),
    "high_watermark": (lambda v: 0 < v <= 1, "a float in (0, 1]"),
    "low_watermark": (lambda v: 0 < v <= 1, "a float in (0, 1]"),
    "byte_stage_min_saving": (lambda v: 0 <= v < 1, "a float in [0, 1)"),
    "select_stickiness": (lambda v: 0 <= v <= 100, "a number in [0, 100]"),
}
#: text field -> most UTF-8 bytes (never a NUL: it would end the name in C and Redis clients)
TEXTS = {"namespace": 256, "remote_key_prefix": 128}


def check_fields(cfg: Any) -> None:
    """Check every field of the dataclass ``cfg`` that a table above (or its annotation) declares,
    in field order: ValueError naming the first bad field and what it allows."""
    for name, optional, allowed in _declared(type(cfg)):
        value = getattr(cfg, name)
        if value is None and optional:
            continue
        if name in RANGES:
            low, high = RANGES[name]
            if name in RANGE_WHY and isinstance(value, int) and not isinstance(value, bool) and value < low:
                raise ValueError(f"{name} must be an int >= {low} ({RANGE_WHY[name]}); got {value!r}")
            check_int(name, value, low, high)
        elif name in NUMBERS:
            test, says = NUMBERS[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not test(value):
                raise ValueError(f"{name} must be {says}; got {value!r}")
        elif name in TEXTS:
            if not isinstance(value, str) or "\x00" in value or len(value.encode()) > TEXTS[name]:
                raise ValueError(f"{name} must be a str of at most {TEXTS[name]} UTF-8 bytes without NUL; "
                                 f"got {value!r:.80}")
        elif allowed == (True, False):
            check_bool(name, value)
        elif True in allowed:  # a flag with a third choice: "True, False or 'auto'"
            if not any(value is a if isinstance(a, bool) else not isinstance(value, bool) and value == a
                       for a in allowed):
                shown = [repr(a) for a in allowed]
                raise ValueError(f"{name} must be {', '.join(shown[:-1])} or {shown[-1]}; got {value!r}")
        else:
            check_choice(name, value, allowed)


@functools.cache
def _declared(cls: type) -> tuple[tuple[str, bool, tuple], ...]:
    """(field, None allowed, allowed values) of each field of ``cls`` a table or annotation declares."""
    hints = typing.get_type_hints(cls)
    out = []
    for name in cls.__dataclass_fields__:
        parts = _union(hints[name])
        optional = type(None) in parts
        allowed = CHOICES.get(name, ())
        if not allowed and all(p is bool or get_origin(p) is Literal or p is type(None) for p in parts):
            allowed = tuple(v for p in parts if p is not type(None)
                            for v in ((True, False) if p is bool else get_args(p)))
        if allowed or name in RANGES or name in NUMBERS or name in TEXTS:
            out.append((name, optional, allowed))
    return tuple(out)


def _union(hint: Any) -> tuple:
    if get_origin(hint) in (typing.Union, types.UnionType):
        return get_args(hint)
    return (hint,)


def check_importance(cfg: Any) -> None:
    """``precision='importance'``: codecs, policy and order that fit mixed precision."""
    if cfg.precision == "fixed":
        return
    if cfg.codec not in PRECISION_CODECS:
        raise ValueError(f"codec must be one of {', '.join(map(repr, PRECISION_CODECS))} with "
                         f"precision='importance'; got {cfg.codec!r}")
    bits = {c: int(c[3:]) for c in PRECISION_CODECS}
    if bits[cfg.heavy_codec] < bits[cfg.codec]:
        raise ValueError(f"heavy_codec must have at least codec's bits ({cfg.codec!r}); got {cfg.heavy_codec!r}")
    if bits[cfg.cold_codec] > bits[cfg.codec]:
        raise ValueError(f"cold_codec must have at most codec's bits ({cfg.codec!r}); got {cfg.cold_codec!r}")
    if cfg.policy not in ("h2o", "snapkv"):
        raise ValueError(f"policy must be 'h2o' or 'snapkv' with precision='importance' (the attention "
                         f"statistic it ranks blocks by); got {cfg.policy!r}")
    if cfg.order != "compress-then-tier":
        raise ValueError(f"order must be 'compress-then-tier' with precision='importance'; got {cfg.order!r}")
    for name in ("host_codec", "disk_codec"):
        if getattr(cfg, name) != cfg.codec:
            raise ValueError(f"{name} must be unset (or equal codec {cfg.codec!r}) with "
                             f"precision='importance'; got {getattr(cfg, name)!r}")
    if cfg.cold_key_outliers is not None and cfg.cold_codec == cfg.codec:
        raise ValueError(f"cold_key_outliers must be None when cold_codec equals codec ({cfg.codec!r}: "
                         f"one codec name, one encoding); got {cfg.cold_key_outliers!r}")
    for name in ("key_codec", "value_codec"):
        if getattr(cfg, name) not in (None, cfg.codec):
            raise ValueError(f"{name} must be None (or equal codec {cfg.codec!r}) with "
                             f"precision='importance'; got {getattr(cfg, name)!r}")


def check_sparse_budget(cfg: Any) -> None:
    """The sparse budget and its fixed parts (sink, window, one open block), filled when known."""
    bt = cfg.block_tokens
    # The sparse budget and its fixed parts are only known in tokens when device_tokens is.
    hot = cfg.device_tokens if cfg.device_bytes is None else None
    if cfg.budget_tokens is None:
        if hot is not None:
            derive(cfg, "budget_tokens", hot)
    else:
        if cfg.budget_tokens < bt:
            raise ValueError(f"budget_tokens must be >= block_tokens ({bt}); got {cfg.budget_tokens}")
        check_whole_blocks(cfg, "budget_tokens", cfg.budget_tokens, bt)
        if hot is not None and cfg.budget_tokens > hot:
            raise ValueError(
                f"budget_tokens must be <= device_tokens ({hot}): the attended blocks are resident "
                f"in L1 while attention runs; got {cfg.budget_tokens}")
    budget = cfg.budget_tokens
    for name in ("sink_tokens", "window_tokens"):
        if getattr(cfg, name) is not None:
            check_whole_blocks(cfg, name, getattr(cfg, name), bt)
    if budget is None:
        # device_bytes without budget_tokens: the store fills the defaults once it knows the budget
        return
    sink, window = cfg.sink_window(budget)
    if cfg.sink_tokens is None:
        derive(cfg, "sink_tokens", sink)
    if cfg.window_tokens is None:
        derive(cfg, "window_tokens", window)
    fixed = round_up(cfg.sink_tokens, bt) + round_up(cfg.window_tokens, bt) + bt
    if budget < fixed:
        raise ValueError(
            f"budget_tokens must be >= sink_tokens + window_tokens + one open block "
            f"(= {fixed} with block_tokens={bt}); got {budget}")


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m
