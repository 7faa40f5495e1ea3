"""Content-addressed block keys: identical token prefixes of the same model map to identical keys.

A block's identity is a hash chained over the token ids of everything before it, so a block
is shared only when its whole prefix is identical (attention makes a block's K/V depend on
every earlier token). The chain is seeded with a model fingerprint key that folds in the model
(its weights digest: ``kvtier.identity``), the codec and its parameters, the layout, ``block_tokens``
and the deployment namespace, and then with the request's salt (its tenant): different models,
encodings, namespaces or tenants never produce the same key.

```
 tokens   | t0 .. t63 | t64 .. t127 | t128 .. t191 | t192 .. t200 (partial: no key)
 hash     |    h0     |     h1      |     h2       |
          h0 = H(seed,      tokens of block 0)
          h1 = H(h0,        tokens of block 1)        seed = H(fp) ; H(fp, salt) with a salt
          h2 = H(h1,        tokens of block 2)
 key(b, layer) = f"{fp}/{layer}/{hex(h_b)}"
```
H is BLAKE2b (16-byte digests, a kvtier personalisation): stable across processes, machines and
Python versions, unlike ``hash()``. Token ids are hashed as little-endian int64, so a list, a
NumPy array and a tensor holding the same ids give the same keys.

Pure functions only: the store decides when to compute keys and what to do with them.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Union

import numpy as np
import torch

TokenIds = Union[Sequence[int], np.ndarray, torch.Tensor]

HASH_BYTES = 16
# v2: the identity gained the weights digest, the full codec parameters and the namespace; the
# new personalisation keeps every key of the v1 scheme a miss even where its inputs coincide
_PERSON_SEED = b"kvtier-fp-v2"
_PERSON_SALT = b"kvtier-salt-v2"
_PERSON_BLOCK = b"kvtier-blk-v2"


def _nonempty_str(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty str; got {value!r}")
    return value


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    return int(value)


def model_fingerprint_key(fingerprint: str, codec: str, block_tokens: int, *,
                          codec_params: Mapping[str, object] | None = None,
                          dtype: str | torch.dtype | None = None,
                          extra: Mapping[str, object] | None = None, namespace: str = "") -> str:
    """A short key naming everything that makes two blocks' stored bytes interchangeable.

    Args:
        fingerprint: the model's identity (``kvtier.models.model_fingerprint``: class,
            name and architecture config hash).
        codec: codec name (``"int4"``, ``"fp16"``, ...).
        block_tokens: tokens per block.
        codec_params: parameters of the codec's output format (group size, axis, ...), JSON-able.
        dtype: the dtype blocks decode to (``"float16"`` or ``torch.float16``).
        extra: any other JSON-able settings that change the stored bytes.
        namespace: the deployment's namespace (``KVTierConfig.namespace``): stores of different
            namespaces never share a key, even on one L3 directory or L4 server.

    Returns:
        ``"m"`` + 32 hex digits; used as the first path component of every block key.
    """
    _nonempty_str("fingerprint", fingerprint)
    _nonempty_str("codec", codec)
    block_tokens = _positive_int("block_tokens", block_tokens)
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if not isinstance(namespace, str):
        raise ValueError(f"namespace must be a str; got {namespace!r}")
    payload = {"fingerprint": fingerprint, "codec": codec, "block_tokens": block_tokens,
               "codec_params": dict(codec_params or {}), "dtype": dtype, "extra": dict(extra or {}),
               "namespace": namespace}
    try:
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    except TypeError as e:
        raise ValueError(f"codec_params and extra must be JSON-able mappings; {e}") from None
    return "m" + hashlib.blake2b(text.encode("utf-8"), digest_size=HASH_BYTES,
                                 person=_PERSON_SEED).hexdigest()


def _token_bytes(token_ids: TokenIds) -> np.ndarray:
    """Token ids as a 1-D little-endian int64 array (a view where possible)."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise ValueError(f"token_ids must hold integers; got a {token_ids.dtype} tensor")
        arr = token_ids.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(token_ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"token_ids must hold integers; got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D (one sequence, no batch dim); got shape {tuple(arr.shape)}")
    if arr.size and arr.min() < 0:
        raise ValueError("token_ids must be >= 0")
    return np.ascontiguousarray(arr, dtype="<i8")


def chain_seed(fp: str, salt: str = "") -> bytes:
    """The digest a chain starts from: the fingerprint key, and the request's salt (a tenant's
    isolation key, as vLLM's ``cache_salt``) when there is one."""
    _nonempty_str("fp", fp)
    if not isinstance(salt, str):
        raise ValueError(f"salt must be a str; got {salt!r}")
    h = hashlib.blake2b(fp.encode("utf-8"), digest_size=HASH_BYTES, person=_PERSON_SEED).digest()
    if salt:
        h = hashlib.blake2b(h + salt.encode("utf-8"), digest_size=HASH_BYTES, person=_PERSON_SALT).digest()
    return h


def chained_block_hashes(token_ids: TokenIds, block_tokens: int, fp: str,
                         parent: str | None = None, salt: str = "") -> list[str]:
    """Hex hash of every full block of ``token_ids``, each chained over all blocks before it.

    Args:
        token_ids: the sequence's token ids, 1-D.
        block_tokens: tokens per block; a partial tail block gets no hash.
        fp: the model fingerprint key (:func:`model_fingerprint_key`), which seeds the chain.
        parent: hex hash of the block just before ``token_ids[0]`` when continuing a chain
            (``token_ids`` then holds only the new tokens, starting on a block boundary).
        salt: the request's tenant key (:func:`chain_seed`); ignored with ``parent``, which
            already carries it.

    Returns:
        ``len(token_ids) // block_tokens`` hex strings of ``2 * HASH_BYTES`` digits.
    """
    _nonempty_str("fp", fp)
    block_tokens = _positive_int("block_tokens", block_tokens)
    ids = _token_bytes(token_ids)
    if parent is None:
        prev = chain_seed(fp, salt)
    else:
        try:
            prev = bytes.fromhex(parent)
        except (TypeError, ValueError):
            prev = b""
        if len(prev) != HASH_BYTES:
            raise ValueError(f"parent must be a {2 * HASH_BYTES}-digit hex block hash or None; got {parent!r}")
    n_full = ids.size // block_tokens
    blocks = ids[: n_full * block_tokens].reshape(n_full, block_tokens)  # [n_full, block_tokens]
    out = []
    for row in blocks:
        h = hashlib.blake2b(prev, digest_size=HASH_BYTES, person=_PERSON_BLOCK)
        h.update(row.tobytes())
        prev = h.digest()
        out.append(prev.hex())
    return out


def block_key(fp: str, layer: int, block_hash: str) -> str:
    """Tier key of one layer of one content-addressed block: ``f"{fp}/{layer}/{block_hash}"``."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
        raise ValueError(f"layer must be an int >= 0; got {layer!r}")
    return f"{fp}/{int(layer)}/{block_hash}"


def chained_block_keys(token_ids: TokenIds, block_tokens: int, layer_count: int, fp: str,
                       parent: str | None = None, salt: str = "") -> list[list[str]]:
    """Tier keys of every (full block, layer) of ``token_ids``.

    Returns:
        ``keys[b][layer]`` for ``b < len(token_ids) // block_tokens`` and ``layer < layer_count``;
        see :func:`chained_block_hashes` for ``parent``.
    """
    layer_count = _positive_int("layer_count", layer_count)
    return [[block_key(fp, layer, h) for layer in range(layer_count)]
            for h in chained_block_hashes(token_ids, block_tokens, fp, parent, salt)]
