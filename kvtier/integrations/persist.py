"""Saving a TieredCache to HDF5 and loading it back in another process.

File layout (h5py; no pickle anywhere, every record parsed by ``unpack_block``):

```
 /                      attrs: format="kvtier-kvcache", version=1, fingerprint, num_layers,
                               kv_heads, head_dim, dtype, block_tokens, codec, config (JSON),
                               batch, tokens
 /seq{b}/layer{l}/records   uint8 [sum of record sizes]  full blocks, each a store block record
                                                         (KVB1 frame: K and V codec records)
 /seq{b}/layer{l}/offsets   int64 [n_blocks + 1]         record b is records[offsets[b]:offsets[b+1]]
 /seq{b}/layer{l}/open      uint8                        the last partial block, raw bytes of
                                                         [2, kv_heads, tokens % block_tokens, head_dim]
```
Full blocks are records in the configuration's L3 codec (``disk_codec``): the persistent
format is the SSD format, and a block that already has such a record (in L3, or in L2 under the
same codec) is written as those bytes, never dequantized and quantized again. The partial block is kept raw, as it is in L1. The file is written
to a temporary name with mode 0o600 and renamed into place.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import torch

from kvtier.compress import get_codec
from kvtier.config import KVTierConfig
from kvtier.store.blockrecord import unpack_block

from .model import model_fingerprint

FORMAT = "kvtier-kvcache"
VERSION = 1

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _raw(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a tensor (any float dtype, bfloat16 included) as a uint8 array."""
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return t.view(torch.uint8).numpy().reshape(-1)


def save_cache(cache, path) -> None:
    """Write every sequence of ``cache`` (a TieredCache) to ``path``."""
    if not cache.seqs or cache.get_seq_length() == 0:
        raise ValueError("cache is empty: nothing to save")
    path = Path(path)
    cfg: KVTierConfig = cache.config
    store = cache.store
    bt = cfg.block_tokens
    name = store.disk_codec  # the codec the store really uses (16-bit ones follow the KV dtype)
    kc = get_codec(name, group_size=cfg.group_size, axis=cfg.key_axis)
    vc = get_codec(name, group_size=cfg.group_size, axis=cfg.value_axis)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # Created owner-only before HDF5 opens it: truncating an existing file keeps its mode.
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs.update({
                "format": FORMAT, "version": VERSION, "fingerprint": cache.fingerprint,
                "num_layers": cache.num_layers, "kv_heads": cache.kv_heads, "head_dim": cache.head_dim,
                "dtype": _dtype_name(cache.dtype), "block_tokens": bt, "codec": name,
                "key_codec_params": json.dumps(kc.params), "value_codec_params": json.dumps(vc.params),
                "config": json.dumps(cfg.to_dict()), "batch": len(cache.seqs),
                "tokens": cache.get_seq_length(),
            })
            for row, seq in enumerate(cache.seqs):
                for layer in range(cache.num_layers):
                    # blocks with a record in the disk codec already (L3, or L2 under the same
                    # codec) are written as those bytes: never dequantized and quantized again
                    recs, tail = store.export_blocks(seq, layer)  # tail: [2, kv_heads, rest, head_dim]
                    offsets = np.zeros(len(recs) + 1, dtype=np.int64)
                    np.cumsum([len(r) for r in recs], out=offsets[1:])
                    g = f.create_group(f"seq{row}/layer{layer}")
                    g.create_dataset("records", data=np.frombuffer(b"".join(recs), dtype=np.uint8))
                    g.create_dataset("offsets", data=offsets)
                    g.create_dataset("open", data=_raw(tail.to(cache.dtype)))
                    g.attrs["tokens"] = len(recs) * bt + tail.shape[2]
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _decode_blocks(records: np.ndarray, offsets: np.ndarray, device) -> tuple[list, list]:
    ks, vs = [], []
    mv = memoryview(records)
    for i in range(len(offsets) - 1):
        ek, ev = unpack_block(mv[int(offsets[i]):int(offsets[i + 1])])
        ks.append(get_codec(ek.codec, **ek.params).decode(ek, device=device))  # [kv_heads, bt, head_dim]
        vs.append(get_codec(ev.codec, **ev.params).decode(ev, device=device))
    return ks, vs


def load_cache(cls, path, config: KVTierConfig, model=None, fingerprint: str | None = None):
    """Build a ``cls`` (TieredCache) holding what :func:`save_cache` wrote to ``path``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path must be an existing kvtier cache file; {str(path)!r} does not exist")
    expected = model_fingerprint(model) if model is not None else fingerprint
    if not expected:
        raise ValueError("TieredCache.load needs model= (or fingerprint=) to check the file belongs to it")
    with h5py.File(path, "r") as f:
        a = f.attrs
        if a.get("format") != FORMAT:
            raise ValueError(f"{str(path)!r} is not a kvtier cache file (format {a.get('format')!r}, "
                             f"expected {FORMAT!r})")
        if int(a["version"]) != VERSION:
            raise ValueError(f"{str(path)!r} has format version {int(a['version'])}; this kvtier reads {VERSION}")
        saved = str(a["fingerprint"])
        if saved != expected:
            raise ValueError(f"model fingerprint mismatch: {str(path)!r} was saved from model {saved!r}, "
                             f"but this model is {expected!r}; refusing to load a cache of another model")
        shape = (int(a["num_layers"]), int(a["kv_heads"]), int(a["head_dim"]))
        dtype = _DTYPES[str(a["dtype"])]
        if model is not None:
            cache = cls(config, model, fingerprint=expected)
            if (cache.num_layers, cache.kv_heads, cache.head_dim) != shape:
                cache.close()
                raise ValueError(f"the model's shape {(cache.num_layers, cache.kv_heads, cache.head_dim)} "
                                 f"(layers, kv_heads, head_dim) differs from the file's {shape}")
        else:
            cache = cls(config, num_layers=shape[0], kv_heads=shape[1], head_dim=shape[2],
                        dtype=dtype, fingerprint=expected)
        try:
            store = cache.store
            batch = int(a["batch"])
            saved_bt = int(a["block_tokens"])
            cache.seqs = [store.add_sequence() for _ in range(batch)]
            for layer in range(shape[0]):
                length = None
                for row, seq in enumerate(cache.seqs):
                    g = f[f"seq{row}/layer{layer}"]
                    ks, vs = _decode_blocks(g["records"][()], g["offsets"][()], cache.device)
                    tokens = int(g.attrs["tokens"])
                    rest = tokens - len(ks) * saved_bt
                    if rest:
                        raw = torch.from_numpy(g["open"][()].copy())
                        tail = raw.view(dtype).view(2, shape[1], rest, shape[2]).to(cache.device)
                        ks.append(tail[0])
                        vs.append(tail[1])
                    k = torch.cat(ks, dim=1)  # [kv_heads, tokens, head_dim]
                    v = torch.cat(vs, dim=1)
                    if k.shape[1] != tokens:
                        raise ValueError(f"{str(path)!r}: seq{row}/layer{layer} holds {k.shape[1]} tokens, "
                                         f"its header says {tokens}")
                    if length is not None and tokens != length:
                        raise ValueError(f"{str(path)!r}: batch rows of layer {layer} differ in length")
                    length = tokens
                    store.append(seq, layer, k.to(cache.dtype), v.to(cache.dtype))
                cache.layers[layer].lazy_initialization(k, v)
                cache.layers[layer].length = length
            store.end_step()
        except BaseException:
            cache.close()
            raise
    return cache

