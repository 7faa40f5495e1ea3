"""Pinned L3 records: the PINS file of a tier directory.

```
 PINS (0o600, JSON)  {"version": 1, "pins": {"<label>": ["<block name>", ...], ...}}
```
A pin is a label and the block names it keeps (``block_name``: a key, with its middle component
``*`` when it has three, so one name covers every layer of a block). Written atomically
(temp file + rename) under an flock of ``PINS.lock``, so two writers do not lose each other's
pins; a DiskTier re-reads it when its mtime or size changes, so pinning reaches a tier that is
serving from the directory without stopping it. JSON, never pickle: the file is data.
"""
from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

PINS_NAME = "PINS"
PINS_LOCK = "PINS.lock"
_VERSION = 1


def block_name(key: str) -> str:
    """``a/*/c`` for a key ``a/b/c`` (every layer of one block); any other key as it is."""
    parts = key.split("/")
    if len(parts) == 3:
        return f"{parts[0]}/*/{parts[2]}"
    return key


@dataclass(frozen=True)
class Pins:
    """Labels -> block names, as read from a PINS file."""

    by_label: dict[str, tuple[str, ...]] = field(default_factory=dict)
    names: frozenset[str] = frozenset()

    def matches(self, key: str) -> bool:
        return bool(self.names) and (key in self.names or block_name(key) in self.names)


def _parse(raw: bytes, path: str) -> Pins:
    try:
        doc = json.loads(raw)
        if doc.get("version") != _VERSION or not isinstance(doc.get("pins"), dict):
            raise ValueError("not a version-1 pin file")
        by_label = {}
        for label, names in doc["pins"].items():
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"pin {label!r} is not a list of block names")
            by_label[str(label)] = tuple(names)
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{path} is not a kvtier pin file ({e}); remove it to drop every pin") from None
    return Pins(by_label, frozenset(n for names in by_label.values() for n in names))


class PinFile:
    """The pins of one directory, re-read when the file changes (``current``)."""

    def __init__(self, dirpath: str) -> None:
        self.path = os.path.join(dirpath, PINS_NAME)
        self._dir = dirpath
        self._stamp: tuple[int, int] | None = None
        self._pins = Pins()

    def current(self) -> Pins:
        """The pins as the file says now (one stat when it has not changed)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._stamp, self._pins = None, Pins()
            return self._pins
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            with open(self.path, "rb") as f:
                self._pins = _parse(f.read(), self.path)
            self._stamp = stamp
        return self._pins

    def _update(self, change) -> Pins:
        fd = os.open(os.path.join(self._dir, PINS_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._stamp = None
            pins = dict(self.current().by_label)
            change(pins)
            tmp = self.path + ".tmp"
            data = json.dumps({"version": _VERSION, "pins": {k: list(v) for k, v in sorted(pins.items())}},
                              indent=1).encode()
            wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(wfd, data)
            finally:
                os.close(wfd)
            os.replace(tmp, self.path)
            self._stamp = None
            return self.current()
        finally:
            os.close(fd)

    def add(self, label: str, names: Iterable[str]) -> Pins:
        """Pin ``names`` under ``label`` (added to what it already pins)."""
        if not isinstance(label, str) or not label or "\0" in label:
            raise ValueError(f"pin label must be a non-empty str; got {label!r}")
        names = sorted({block_name(n) for n in names})
        if not names:
            raise ValueError(f"pin {label!r} names no block (a prefix shorter than one block pins nothing)")

        def change(pins: dict) -> None:
            pins[label] = tuple(sorted(set(pins.get(label, ())) | set(names)))
        return self._update(change)

    def remove(self, label: str) -> Pins:
        """Drop the pin ``label``; ValueError naming the labels there are when it is unknown."""
        def change(pins: dict) -> None:
            if label not in pins:
                raise ValueError(f"no pin labelled {label!r}; pins: {sorted(pins) or 'none'}")
            del pins[label]
        return self._update(change)
