"""The ``mooncake://`` URL of an L4 Mooncake pool (the form is in kvtier/tiers/mooncake.py's
docstring): parsed and checked without the Mooncake client, so a config is checked before any
client is imported."""
from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit

from .reach import split_url

_URL_FORM = ("mooncake://HOST:RPC_PORT?metadata=http://HOST:PORT/metadata[&admin=http://HOST:PORT]"
             "[&segment_bytes=N][&buffer_bytes=N][&protocol=tcp|rdma][&local_hostname=IP]")
_PARAMS = ("metadata", "admin", "segment_bytes", "buffer_bytes", "protocol", "local_hostname")
_PROTOCOLS = ("tcp", "rdma")
#: The client refuses segments and transfer buffers under 16 MiB.
MIN_BUFFER_BYTES = 16 << 20
DEFAULT_BUFFER_BYTES = 64 << 20
DEFAULT_ADMIN_PORT = 9003
_SIZE = re.compile(r"([0-9]+)(|B|KiB|MiB|GiB)")
_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _bad_url(url: object, why: str) -> ValueError:
    return ValueError(f"remote_url must look like {_URL_FORM}; {why}: {url!r}")


def _parse_size(url: str, name: str, text: str) -> int:
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise _bad_url(url, f"{name} must be a byte count (digits, optionally KiB/MiB/GiB), got {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2)]


class MooncakeURL:
    """A parsed, checked ``mooncake://`` URL (see the module docstring)."""

    def __init__(self, url: object) -> None:
        u, port = split_url(url, _bad_url)
        if u.scheme != "mooncake":
            raise _bad_url(url, f"unsupported scheme {u.scheme!r}")
        if not u.hostname or port is None or not 0 < port < 65536:
            raise _bad_url(url, "HOST and RPC_PORT (1..65535) of the master are required")
        if u.path not in ("", "/") or u.username or u.password or u.fragment:
            raise _bad_url(url, "no path, user or fragment is allowed")
        try:
            pairs = parse_qsl(u.query, keep_blank_values=True, strict_parsing=bool(u.query))
        except ValueError as e:
            raise _bad_url(url, f"bad query ({e})") from None
        q: dict[str, str] = {}
        for k, v in pairs:
            if k not in _PARAMS:
                raise _bad_url(url, f"unknown parameter {k!r} (allowed: {', '.join(_PARAMS)})")
            if k in q:
                raise _bad_url(url, f"parameter {k!r} given twice")
            q[k] = v
        self.url = url
        self.host, self.rpc_port = u.hostname, port
        self.master = f"{u.hostname}:{port}" if ":" not in u.hostname else f"[{u.hostname}]:{port}"
        if "metadata" not in q:
            raise _bad_url(url, "metadata=http://HOST:PORT/metadata (the metadata server) is required")
        self.metadata = self._http(url, "metadata", q["metadata"], need_path=True)
        admin = q.get("admin", f"http://{self.master.rsplit(':', 1)[0]}:{DEFAULT_ADMIN_PORT}")
        self.admin = self._http(url, "admin", admin, need_path=False).rstrip("/")
        self.segment_bytes = _parse_size(url, "segment_bytes", q.get("segment_bytes", "0"))
        if self.segment_bytes and self.segment_bytes < MIN_BUFFER_BYTES:
            raise _bad_url(url, f"segment_bytes must be 0 or at least {MIN_BUFFER_BYTES} (16 MiB)")
        self.buffer_bytes = _parse_size(url, "buffer_bytes", q.get("buffer_bytes", str(DEFAULT_BUFFER_BYTES)))
        if self.buffer_bytes < MIN_BUFFER_BYTES:
            raise _bad_url(url, f"buffer_bytes must be at least {MIN_BUFFER_BYTES} (16 MiB)")
        self.protocol = q.get("protocol", "tcp")
        if self.protocol not in _PROTOCOLS:
            raise _bad_url(url, f"protocol must be one of {_PROTOCOLS}, got {self.protocol!r}")
        self.local_hostname = q.get("local_hostname") or None
        if self.local_hostname is not None and not re.fullmatch(r"[A-Za-z0-9.:\-_\[\]]+", self.local_hostname):
            raise _bad_url(url, f"local_hostname must be a host name or address, got {self.local_hostname!r}")

    @staticmethod
    def _http(url: str, name: str, value: str, need_path: bool) -> str:
        try:
            v = urlsplit(value)
            v.port  # noqa: B018 - raises on a bad port
        except ValueError as e:
            raise _bad_url(url, f"{name} is not a URL ({e})") from None
        if v.scheme not in ("http", "https") or not v.hostname or (need_path and not v.path.strip("/")):
            raise _bad_url(url, f"{name} must be an http(s)://HOST:PORT{'/PATH' if need_path else ''} URL, "
                                f"got {value!r}")
        return value


def check_url(url: object) -> str:
    """Validate a ``mooncake://`` URL; returns it unchanged. Raises ValueError naming ``remote_url``."""
    MooncakeURL(url)
    return url  # type: ignore[return-value]


__all__ = ["MooncakeURL", "check_url", "MIN_BUFFER_BYTES", "DEFAULT_BUFFER_BYTES", "DEFAULT_ADMIN_PORT"]
