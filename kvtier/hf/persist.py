"""Saving a TieredCache to HDF5 and loading it back in another process.

File layout (h5py; no pickle anywhere, every record parsed by ``unpack_block``):

```
 /                      attrs: format="kvtier-kvcache", version=2, fingerprint, num_layers,
                               kv_heads, head_dim, dtype, block_tokens, codec,
                               key_codec_params, value_codec_params, config (JSON), batch,
                               tokens, datasets (JSON), header_crc
 /seq{b}/layer{l}/records   uint8 [sum of record sizes]  full blocks, each a store block record
                                                         (KVB1 frame: K and V codec records)
 /seq{b}/layer{l}/offsets   int64 [n_blocks + 1]         record b is records[offsets[b]:offsets[b+1]]
 /seq{b}/layer{l}/open      uint8                        the last partial block, raw bytes of
                                                         [2, kv_heads, tokens % block_tokens, head_dim]
```
Every row holds ``tokens`` tokens in every layer; ``n_blocks = tokens // block_tokens``.

Integrity: ``datasets`` maps each dataset's path to ``[nbytes, crc32]``, the CRC seeded with the
path itself, so a dataset moved to another layer or sequence fails its check as surely as a
flipped byte. ``header_crc`` is the CRC32 of the canonical JSON of every other root attribute,
``datasets`` included. A load checks, in this order and before it builds a cache: the header
and its CRC; every declared size against what the header implies (shape, codec, tokens) and
against the configuration's capacity, so that no dataset is read whose size was not expected;
then every dataset's bytes against its CRC, one dataset in memory at a time. Only a file that
passed all of that is decoded into the store. Anything malformed raises
:class:`SavedCacheError`, a ``ValueError`` that names the dataset or attribute.

Full blocks are records in the configuration's L3 codec (``disk_codec``): the persistent
format is the SSD format, and a block that already has such a record (in L3, or in L2 under the
same codec) is written as those bytes, never dequantized and quantized again. The partial block
is kept raw, as it is in L1. The file is written to a temporary name with mode 0o600 and
renamed into place.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import torch

from kvtier._crc import crc32
from kvtier.compress import get_codec
from kvtier.config import CODECS, GROUP_SIZES, KVTierConfig
from kvtier.identity import model_identity
from kvtier.store.blockrecord import pack_block, unpack_block


FORMAT = "kvtier-kvcache"
VERSION = 2

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# header attributes and their types; header_crc covers all of them
_STR_ATTRS = ("format", "fingerprint", "dtype", "codec", "key_codec_params", "value_codec_params",
              "config", "datasets")
_INT_ATTRS = ("version", "num_layers", "kv_heads", "head_dim", "block_tokens", "batch", "tokens")
# present only when a role's codec is not ``codec`` (key_codec/value_codec): files of one codec
# for both roles are written, and read, as before
_ROLE_ATTRS = ("key_codec", "value_codec")
_CODEC_PARAMS = {"group_size", "axis", "outliers", "zero_point", "transform"}
# bounds on the shape a header may declare (far above any model; they keep the arithmetic exact)
_MAX_DIM = 1 << 16
_MAX_TOKENS = 1 << 31
# what h5py raises on a damaged object header, heap or B-tree
_HDF5_ERRORS = (OSError, RuntimeError, KeyError, TypeError, IndexError, OverflowError, UnicodeDecodeError)
# a block record may exceed the size of a zero block's record by its variable header fields
_RECORD_SLACK = 256


class SavedCacheError(ValueError):
    """A saved-cache file that is malformed, damaged or inconsistent; the message names the
    attribute or dataset at fault. Nothing is loaded from such a file."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _raw(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a tensor (any float dtype, bfloat16 included) as a uint8 array."""
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return t.view(torch.uint8).numpy().reshape(-1)


def _crc(name: str, data: np.ndarray) -> int:
    """CRC32 of a dataset's bytes, seeded with its path (binds the data to its place)."""
    return crc32(np.ascontiguousarray(data).view(np.uint8).data, crc32(name.encode("utf-8")))


def _header_crc(header: dict) -> int:
    return crc32(json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def save_cache(cache, path) -> None:
    """Write every sequence of ``cache`` (a TieredCache) to ``path``."""
    if not cache.seqs or cache.get_seq_length() == 0:
        raise ValueError("cache is empty: nothing to save")
    path = Path(path).expanduser()
    cfg: KVTierConfig = cache.config
    store = cache.store
    bt = cfg.block_tokens
    # the codec the store really uses (16-bit ones follow the KV dtype); plain str for HDF5
    name = str(store.disk_codec)
    kc, vc = cfg.codec_pair(name)
    tokens = cache.get_seq_length()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # Created owner-only before HDF5 opens it: truncating an existing file keeps its mode.
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    try:
        datasets: dict[str, list[int]] = {}
        with h5py.File(tmp, "w") as f:
            for row, seq in enumerate(cache.seqs):
                for layer in range(cache.num_layers):
                    # blocks with a record in the disk codec already (L3, or L2 under the same
                    # codec) are written as those bytes: never dequantized and quantized again
                    recs, tail = store.export_blocks(seq, layer)  # tail: [2, kv_heads, rest, head_dim]
                    if len(recs) * bt + tail.shape[2] != tokens:
                        raise ValueError(f"seq {row} layer {layer} holds {len(recs) * bt + tail.shape[2]} "
                                         f"tokens, the cache {tokens}: save a cache whose layers agree")
                    offsets = np.zeros(len(recs) + 1, dtype=np.int64)
                    np.cumsum([len(r) for r in recs], out=offsets[1:])
                    parts = {"records": np.frombuffer(b"".join(recs), dtype=np.uint8), "offsets": offsets,
                             "open": _raw(tail.to(cache.dtype))}
                    for part, data in parts.items():
                        ds = f"seq{row}/layer{layer}/{part}"
                        f.create_dataset(ds, data=data)
                        datasets[ds] = [int(data.nbytes), _crc(ds, data)]
            header = {
                "format": FORMAT, "version": VERSION, "fingerprint": str(cache.fingerprint),
                "num_layers": int(cache.num_layers), "kv_heads": int(cache.kv_heads),
                "head_dim": int(cache.head_dim), "dtype": _dtype_name(cache.dtype), "block_tokens": int(bt),
                "codec": name,
                "key_codec_params": json.dumps(kc.params), "value_codec_params": json.dumps(vc.params),
                "config": json.dumps(cfg.to_dict()), "batch": len(cache.seqs), "tokens": int(tokens),
                "datasets": json.dumps(datasets, sort_keys=True),
            }
            header.update({attr: c.name for attr, c in zip(_ROLE_ATTRS, (kc, vc)) if c.name != name})
            f.attrs.update(header)
            f.attrs["header_crc"] = _header_crc(header)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# -- reading -------------------------------------------------------------------------------------

class _Reader:
    """The checks of one file, in the order the module docstring gives."""

    def __init__(self, f: h5py.File, path: Path, config: KVTierConfig):
        self.f = f
        self.where = str(path)
        self.config = config

    def bad(self, what: str) -> SavedCacheError:
        return SavedCacheError(f"{self.where!r} is not a valid kvtier cache file: {what}")

    def header(self) -> dict:
        a = self.f.attrs
        fmt = _attr(a, "format")
        if fmt != FORMAT:
            raise SavedCacheError(f"{self.where!r} is not a kvtier cache file (format {fmt!r}, "
                                  f"expected {FORMAT!r})")
        version = _attr(a, "version")
        if not isinstance(version, int) or version != VERSION:
            raise SavedCacheError(f"{self.where!r} has format version {version!r}; this kvtier reads "
                                  f"version {VERSION} (files without checksums, version 1, must be saved again)")
        h: dict = {}
        for name in _STR_ATTRS + _INT_ATTRS:
            v = _attr(a, name)
            want, kind = (str, "a str") if name in _STR_ATTRS else (int, "an int")
            if not isinstance(v, want) or isinstance(v, bool):
                raise self.bad(f"attribute {name!r} must be {kind}; got {v!r:.80}")
            h[name] = v
        for name in _ROLE_ATTRS:
            v = _attr(a, name)
            if v is not None:
                if not isinstance(v, str):
                    raise self.bad(f"attribute {name!r} must be a str; got {v!r:.80}")
                h[name] = v
        crc = _attr(a, "header_crc")
        if not isinstance(crc, int) or crc != _header_crc(h):
            raise self.bad("the header's checksum (header_crc) does not match its attributes: "
                           "the file is damaged or was edited")
        return h

    def check_shape(self, h: dict) -> dict:
        """Everything the header declares, checked for consistency; returns the parsed plan."""
        for name in ("num_layers", "kv_heads", "head_dim", "block_tokens", "batch"):
            if not 1 <= h[name] <= _MAX_DIM:
                raise self.bad(f"attribute {name!r} must be in [1, {_MAX_DIM}]; got {h[name]}")
        if not 1 <= h["tokens"] <= _MAX_TOKENS:
            raise self.bad(f"attribute 'tokens' must be in [1, {_MAX_TOKENS}]; got {h['tokens']}")
        if h["dtype"] not in _DTYPES:
            raise self.bad(f"attribute 'dtype' must be one of {sorted(_DTYPES)}; got {h['dtype']!r}")
        for name in ("codec", *_ROLE_ATTRS):
            if h.get(name, h["codec"]) not in CODECS:
                raise self.bad(f"attribute {name!r} must be one of {CODECS}; got {h[name]!r}")
        params = {}
        for role in ("key_codec_params", "value_codec_params"):
            try:
                p = json.loads(h[role])
            except ValueError:
                raise self.bad(f"attribute {role!r} is not JSON") from None
            if not isinstance(p, dict) or not set(p) <= _CODEC_PARAMS \
                    or p.get("group_size", GROUP_SIZES[0]) not in GROUP_SIZES \
                    or p.get("zero_point", 1) not in (0, 1) or isinstance(p.get("zero_point"), bool):
                raise self.bad(f"attribute {role!r} must be codec parameters (group_size, axis, outliers, "
                               f"zero_point, transform); got {p!r:.80}")
            if "zero_point" in p:  # a record param (0 or 1); get_codec takes a bool
                p = {**p, "zero_point": p["zero_point"] == 1}
            params[role] = p
        try:
            datasets = json.loads(h["datasets"])
        except ValueError:
            raise self.bad("attribute 'datasets' is not JSON") from None
        if not isinstance(datasets, dict):
            raise self.bad("attribute 'datasets' must map dataset paths to [nbytes, crc32]")
        dtype = _DTYPES[h["dtype"]]
        shape = (h["kv_heads"], h["block_tokens"], h["head_dim"])  # one role of one block
        try:
            kc = get_codec(h.get("key_codec", h["codec"]), **params["key_codec_params"])
            vc = get_codec(h.get("value_codec", h["codec"]), **params["value_codec_params"])
            zero = torch.zeros(shape, dtype=dtype)
            record_bytes = len(pack_block(kc.encode(zero), vc.encode(zero)))
        except ValueError as e:
            raise self.bad(f"codecs {h.get('key_codec', h['codec'])!r} / {h.get('value_codec', h['codec'])!r} "
                           f"with {params} cannot encode a {dtype} block of "
                           f"{shape}: {e}") from None
        n_blocks, rest = divmod(h["tokens"], h["block_tokens"])
        elem = torch.empty((), dtype=dtype).element_size()
        plan = {"dtype": dtype, "n_blocks": n_blocks, "rest": rest, "codecs": (kc, vc),
                "record_max": record_bytes + _RECORD_SLACK,
                "open_bytes": 2 * h["kv_heads"] * rest * h["head_dim"] * elem,
                "datasets": datasets}
        self.check_capacity(h, n_blocks * record_bytes)
        expected = {f"seq{row}/layer{layer}/{part}" for row in range(h["batch"])
                    for layer in range(h["num_layers"]) for part in ("records", "offsets", "open")}
        if set(datasets) != expected:
            missing = sorted(expected - set(datasets))[:3]
            extra = sorted(set(datasets) - expected, key=str)[:3]
            raise self.bad(f"attribute 'datasets' must list every seq/layer dataset for batch "
                           f"{h['batch']} x {h['num_layers']} layers (missing {missing}, unexpected {extra})")
        for name, entry in datasets.items():
            if not (isinstance(entry, list) and len(entry) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in entry)):
                raise self.bad(f"attribute 'datasets' entry {name!r} must be [nbytes, crc32]; got {entry!r:.80}")
        return plan

    def check_capacity(self, h: dict, encoded_bytes_per_row: int) -> None:
        """The file's KV must fit the tiers of the configuration it is loaded into."""
        cfg = self.config
        room = cfg.host_bytes + (cfg.disk_bytes if cfg.disk_path is not None else 0)
        need = h["batch"] * h["num_layers"] * encoded_bytes_per_row
        if need > room:
            raise ValueError(
                f"{self.where!r} holds {h['batch']} x {h['tokens']:,} tokens ({need:,} bytes encoded as "
                f"{h['codec']}), more than this configuration's L2 and L3 hold (host_bytes + disk_bytes = "
                f"{room:,} bytes): raise host_bytes or set disk_path / disk_bytes")

    def dataset(self, name: str, dtype: np.dtype, length: int | None, max_length: int,
                plan: dict) -> h5py.Dataset:
        """The dataset ``name``, its declared type and size checked before anything is read."""
        try:
            ds = self.f[name]
        except (KeyError, ValueError, OSError, RuntimeError, TypeError):
            raise self.bad(f"dataset {name!r} is missing or unreadable") from None
        if not isinstance(ds, h5py.Dataset):
            raise self.bad(f"{name!r} must be a dataset; got a {type(ds).__name__}")
        if ds.dtype != dtype or ds.ndim != 1:
            raise self.bad(f"dataset {name!r} must be 1-D {dtype}; got {ds.dtype} {ds.shape}")
        n = int(ds.shape[0])
        if (length is not None and n != length) or n > max_length:
            raise self.bad(f"dataset {name!r} declares {n:,} elements; the header implies "
                           f"{length if length is not None else f'at most {max_length:,}'}")
        declared = plan["datasets"][name][0]
        if n * ds.dtype.itemsize != declared:
            raise self.bad(f"dataset {name!r} holds {n * ds.dtype.itemsize:,} bytes; the header lists {declared:,}")
        if ds.compression is not None or ds.chunks is not None or ds.external:
            raise self.bad(f"dataset {name!r} must be stored contiguous and uncompressed, as save() writes it")
        if n and ds.id.get_storage_size() != n * ds.dtype.itemsize:
            raise self.bad(f"dataset {name!r} declares {n * ds.dtype.itemsize:,} bytes but stores "
                           f"{ds.id.get_storage_size():,}")
        return ds

    def read(self, name: str, dtype: np.dtype, length: int | None, max_length: int, plan: dict) -> np.ndarray:
        """A dataset's contents, checked against its CRC."""
        ds = self.dataset(name, dtype, length, max_length, plan)
        try:
            data = ds[()]
        except (OSError, RuntimeError, ValueError, TypeError) as e:
            raise self.bad(f"dataset {name!r} cannot be read ({e})") from None
        if _crc(name, data) != plan["datasets"][name][1]:
            raise self.bad(f"dataset {name!r} fails its checksum: the file is damaged or was edited")
        return data

    def layer(self, row: int, layer: int, plan: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(records, offsets, open) of one sequence and layer, every check passed."""
        g = f"seq{row}/layer{layer}"
        n = plan["n_blocks"]
        offsets = self.read(f"{g}/offsets", np.dtype(np.int64), n + 1, n + 1, plan)
        records = self.read(f"{g}/records", np.dtype(np.uint8), None, n * plan["record_max"], plan)
        lengths = np.diff(offsets)
        if offsets[0] != 0 or offsets[-1] != records.size or (lengths < 1).any() \
                or (lengths > plan["record_max"]).any():
            raise self.bad(f"dataset {g + '/offsets'!r} does not cut {g + '/records'!r} into {n} block "
                           f"records of at most {plan['record_max']:,} bytes each")
        tail = self.read(f"{g}/open", np.dtype(np.uint8), plan["open_bytes"], plan["open_bytes"], plan)
        return records, offsets, tail

    def blocks(self, row: int, layer: int, plan: dict, h: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [kv_heads, tokens, head_dim] of one sequence and layer, on ``device``."""
        records, offsets, tail = self.layer(row, layer, plan)
        kc, vc = plan["codecs"]
        shape = (h["kv_heads"], h["block_tokens"], h["head_dim"])
        ks, vs = [], []
        mv = memoryview(records)
        for i in range(plan["n_blocks"]):
            try:
                ek, ev = unpack_block(mv[int(offsets[i]):int(offsets[i + 1])])
                if (ek.codec, ek.params, ev.codec, ev.params) != (kc.name, kc.params, vc.name, vc.params) \
                        or tuple(ek.shape) != shape or tuple(ev.shape) != shape \
                        or ek.dtype != plan["dtype"] or ev.dtype != plan["dtype"]:
                    raise ValueError(f"a {ek.codec} {ek.dtype} {tuple(ek.shape)} record where the header "
                                     f"declares {kc.name} {plan['dtype']} {shape}")
                ks.append(kc.decode(ek, device=device))  # [kv_heads, block_tokens, head_dim]
                vs.append(vc.decode(ev, device=device))
            except ValueError as e:
                raise self.bad(f"block {i} of seq{row}/layer{layer}: {e}") from None
        if plan["rest"]:
            raw = torch.from_numpy(tail.copy()).view(plan["dtype"])
            open_kv = raw.view(2, h["kv_heads"], plan["rest"], h["head_dim"]).to(device)
            ks.append(open_kv[0])
            vs.append(open_kv[1])
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)  # [kv_heads, tokens, head_dim]


def _attr(attrs, name: str):
    """A root attribute as a Python str or int, or None when absent or of another type."""
    try:
        if name not in attrs:
            return None
        v = attrs[name]
    except (OSError, RuntimeError, KeyError, TypeError, ValueError):
        return None
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if isinstance(v, str):
        return v
    if isinstance(v, (np.integer, int)) and not isinstance(v, (bool, np.bool_)):
        return int(v)
    return None


def _open(path: Path) -> h5py.File:
    try:
        return h5py.File(path, "r")
    except (OSError, RuntimeError, ValueError) as e:
        raise SavedCacheError(f"{str(path)!r} is not a readable HDF5 file ({e})") from None


def load_cache(cls, path, config: KVTierConfig, model=None, fingerprint: str | None = None):
    """Build a ``cls`` (TieredCache) holding what :func:`save_cache` wrote to ``path``.

    Raises:
        SavedCacheError: the file is malformed or damaged (nothing is loaded).
        ValueError: the file is sound but does not belong here (another model, a shape that
            differs from the model's, more KV than ``config``'s tiers hold).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"path must be an existing kvtier cache file; {str(path)!r} does not exist")
    if not isinstance(config, KVTierConfig):
        raise ValueError(f"config must be a KVTierConfig; got {type(config).__name__}")
    expected = model_identity(model) if model is not None else fingerprint
    if model is not None and not expected:
        raise ValueError("TieredCache.load cannot tell which model this is (its weights are not readable: "
                         "on the meta device or offloaded), so it cannot check the file belongs to it; "
                         "load the model's weights in memory first")
    if not expected:
        raise ValueError("TieredCache.load needs model= (or fingerprint=) to check the file belongs to it")
    with _open(path) as f:
        r = _Reader(f, path, config)
        try:
            h = r.header()
            if h["fingerprint"] != expected:
                raise ValueError(f"model fingerprint mismatch: {str(path)!r} was saved from model "
                                 f"{h['fingerprint']!r}, but this model is {expected!r} (other weights, "
                                 f"adapter or config, or a file of an earlier identity scheme); refusing "
                                 f"to load a cache of another computation")
            plan = r.check_shape(h)
            # every dataset checked (sizes, then CRC) before a cache exists: a damaged file loads nothing
            for row in range(h["batch"]):
                for layer in range(h["num_layers"]):
                    r.layer(row, layer, plan)
        except _HDF5_ERRORS as e:  # damage below what the checks read: HDF5's own structures
            raise r.bad(f"its HDF5 structure is damaged ({type(e).__name__}: {e})") from None
        shape = (h["num_layers"], h["kv_heads"], h["head_dim"])
        if model is not None:
            cache = cls(config, model, fingerprint=expected)
            if (cache.num_layers, cache.kv_heads, cache.head_dim) != shape:
                cache.close()
                raise ValueError(f"the model's shape {(cache.num_layers, cache.kv_heads, cache.head_dim)} "
                                 f"(layers, kv_heads, head_dim) differs from the file's {shape}")
        else:
            cache = cls(config, num_layers=shape[0], kv_heads=shape[1], head_dim=shape[2],
                        dtype=plan["dtype"], fingerprint=expected)
        try:
            store = cache.store
            cache._rows.register(h["batch"])  # all or none
            for layer in range(shape[0]):
                for row, seq in enumerate(cache.seqs):
                    k, v = r.blocks(row, layer, plan, h, cache.device)
                    store.append(seq, layer, k.to(cache.dtype), v.to(cache.dtype))
                cache.layers[layer].lazy_initialization(k, v)
                cache.layers[layer].length = h["tokens"]
            store.end_step()
        except BaseException:
            cache.close()
            raise
    return cache


__all__ = ["save_cache", "load_cache", "SavedCacheError", "FORMAT", "VERSION"]
