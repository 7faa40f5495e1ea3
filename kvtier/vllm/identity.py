"""What a vLLM engine's blocks are named by: the checkpoint it loads, and each request's inputs.

vLLM-free (the connector hands it paths, dicts and vLLM's block hashes), so it is unit-tested in
the main suite. The scheduler process holds no model object, so the weights half of the identity
is read from the checkpoint files the engine loads:

```
 engine identity = identity_of(architecture, config_identity(hf_config) + quantization,
                               checkpoint digest)                       kvtier.identity
 checkpoint digest = weights_digest over the checkpoint's tensors, read in place (mmap):
     safetensors  every *.safetensors file vLLM loads (the index's weight_map when there is one)
     GGUF         every tensor, named with its GGML type (quantized blocks are its bytes)
     hub id       the commit it was pinned to (revision=<40 hex digits>), or the one the local
                  Hugging Face cache resolves it to (the snapshot vLLM loads): a commit names its files
 block key      = H( kvtier chain over token ids      seeded by the engine identity, codec, layout,
                                                      namespace, and the request's salt,
                   vLLM's block hash of the block )   which folds LoRA name+path, multimodal item
                                                      hashes, prompt-embedding digests, cache_salt
 request salt   = cache_salt, and the LoRA adapter's name, path and weights digest
```
Anything else (``.bin``/``.pt`` pickles, ``load_format="dummy"``, a hub id neither pinned to a
commit nor in the local cache, an adapter that is not a local directory of safetensors) gives no identity: nothing of
that engine (or request) is stored or loaded, rather than a guess.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from kvtier.identity import NoIdentity, config_identity, identity_of, weights_digest
from kvtier.store.prefix import HASH_BYTES

__all__ = ["NoIdentity", "checkpoint_digest", "adapter_digest", "engine_identity", "request_salt",
           "fold_block_hashes", "READABLE_LOAD_FORMATS"]

# load formats whose weights are the checkpoint files read here
READABLE_LOAD_FORMATS = ("auto", "safetensors", "fastsafetensors", "gguf")
_PERSON_FOLD = b"kvtier-vllm-v2"
_COMMIT = re.compile(r"[0-9a-f]{40}")
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
              "F8_E5M2": torch.float8_e5m2}


def _safetensors_tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of one safetensors file as a zero-copy view of a read-only memory map."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= 100 << 20:
            raise NoIdentity(f"{path}: not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise NoIdentity(f"{path}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    size = path.stat().st_size
    # copy-on-write: torch wants a writable buffer, and nothing here writes (no page is copied)
    data = np.memmap(path, dtype=np.uint8, mode="c") if size > 8 + n else np.empty(0, np.uint8)
    out = []
    for name, info in header.items():
        dtype = _ST_DTYPES.get(info.get("dtype"))
        begin, end = info["data_offsets"]
        if dtype is None or not 0 <= begin <= end <= size - 8 - n:
            raise NoIdentity(f"{path}: tensor {name!r} of dtype {info.get('dtype')!r} at {begin}..{end} "
                             f"cannot be read")
        raw = torch.from_numpy(data[8 + n + begin:8 + n + end])  # [bytes], the file's pages
        out.append((name, raw.view(dtype).reshape(info["shape"])))
    return out


def _gguf_tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    try:
        import gguf
    except ImportError:
        raise NoIdentity(f"{path}: reading a GGUF file needs the 'gguf' package") from None
    try:
        reader = gguf.GGUFReader(str(path), "c")  # copy-on-write, as for safetensors
    except (ValueError, OSError) as e:
        raise NoIdentity(f"{path}: unreadable GGUF file ({e})") from None
    # a quantized tensor's data is its GGML blocks as bytes: the type is named with it
    return [(f"{t.name}|{t.tensor_type.name}|{[int(d) for d in t.shape]}", torch.from_numpy(np.asarray(t.data)))
            for t in reader.tensors]


def _safetensors_files(root: Path) -> list[Path]:
    """The safetensors files vLLM loads from a directory: those of the index when there is one
    (repositories ship other copies beside it, e.g. ``consolidated.safetensors``), else all."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise NoIdentity(f"{index}: unreadable index ({e})") from None
        return [root / n for n in names]
    return sorted(root.glob("*.safetensors"))


def checkpoint_digest(path: str | os.PathLike) -> str:
    """A 32-hex-digit digest of the weights in a local checkpoint: a directory of safetensors
    shards, one ``.safetensors`` file or one ``.gguf`` file.

    Every tensor's name, dtype and shape, plus :func:`kvtier.identity.weights_digest` of its bytes
    (every byte read once, through the page cache): any one changed element changes it.

    Raises:
        NoIdentity: no readable weights there (pickled ``.bin``/``.pt`` only, a missing shard, an
            unknown dtype); the caller must not share blocks of that model.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        files = _safetensors_files(p)
        if not files:
            raise NoIdentity(f"{p}: no safetensors weights (pickled .bin/.pt checkpoints are not read)")
        tensors = []
        for f in files:
            if not f.is_file():
                raise NoIdentity(f"{f}: shard missing")
            tensors += _safetensors_tensors(f)
        # named without their shard: how the bytes were split is not what they are
        if len({n for n, _ in tensors}) != len(tensors):
            raise NoIdentity(f"{p}: a tensor name occurs in more than one shard")
        return weights_digest(tensors)
    if p.is_file() and p.suffix == ".safetensors":
        return weights_digest(_safetensors_tensors(p))
    if p.is_file() and p.suffix == ".gguf":
        return weights_digest(_gguf_tensors(p))
    raise NoIdentity(f"{p}: not a local directory of safetensors, a .safetensors or a .gguf file")


def engine_identity(model: str, revision: str | None, load_format: str, hf_config: dict,
                    quantization: str | None) -> str:
    """The identity of what an engine computes (:func:`kvtier.identity.identity_of`).

    Args:
        model: ``model_config.model``, a local path or a hub id.
        revision: ``model_config.revision``; a hub id is accepted only pinned to a commit.
        load_format: vLLM's ``load_format``; one of :data:`READABLE_LOAD_FORMATS`.
        hf_config: the model's transformers config as a dict.
        quantization: vLLM's online ``quantization`` method (changes the weights used), or None.
    Raises:
        NoIdentity: the weights cannot be read; nothing of this engine may be shared.
    """
    if load_format not in READABLE_LOAD_FORMATS:
        raise NoIdentity(f"load_format {load_format!r} does not read the checkpoint's weights as they are "
                         f"(readable: {READABLE_LOAD_FORMATS})")
    if Path(model).expanduser().exists():
        weights = checkpoint_digest(model)
    elif revision and _COMMIT.fullmatch(revision):
        weights = f"hub:{model}@{revision}"  # a git commit names its files' contents
    elif (commit := _cached_commit(model, revision)) is not None:
        weights = f"hub:{model}@{commit}"
    else:
        raise NoIdentity(f"model {model!r} is not a local path, revision {revision!r} is not a commit "
                         f"hash, and the local Hugging Face cache does not resolve it to one: its weights "
                         f"cannot be named")
    arch = hf_config.get("architectures") or [hf_config.get("model_type", "model")]
    config = dict(config_identity(hf_config), quantization=quantization)
    return identity_of(f"vllm:{arch[0]}", config, weights, {})


def _cached_commit(model: str, revision: str | None) -> str | None:
    """The commit a hub id (at ``revision``, default ``main``) resolves to in the local Hugging
    Face cache, the snapshot vLLM loads its files from; None when it is not cached there."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json", revision=revision or "main")
    except (ValueError, OSError):  # not a valid repo id
        return None
    if not isinstance(found, str):  # None or the "known missing" sentinel
        return None
    commit = Path(found).parent.name  # .../snapshots/<commit>/config.json
    return commit if _COMMIT.fullmatch(commit) else None


def adapter_digest(path: str | os.PathLike) -> str:
    """Digest of a LoRA adapter directory: its ``adapter_config.json`` (rank, alpha, target
    modules) and the weights of its safetensors files. Raises NoIdentity when either is missing."""
    p = Path(path).expanduser()
    cfg = p / "adapter_config.json"
    if not cfg.is_file():
        raise NoIdentity(f"{p}: not a local LoRA adapter directory (no adapter_config.json)")
    try:
        config = json.loads(cfg.read_text())
    except ValueError as e:
        raise NoIdentity(f"{cfg}: unreadable ({e})") from None
    config.pop("base_model_name_or_path", None)  # where it was trained from, not what it computes
    weights = checkpoint_digest(p)
    payload = json.dumps({"config": config, "weights": weights}, sort_keys=True, default=str)
    return hashlib.blake2b(payload.encode(), digest_size=16, person=_PERSON_FOLD).hexdigest()


def request_salt(cache_salt: str | None, lora: tuple[str, str, str] | None) -> str:
    """The salt of a request's chain: its ``cache_salt`` (tenant) and its LoRA adapter as
    ``(name, path, adapter_digest)``; ``""`` for a plain request, so every plain request of a
    namespace shares one chain."""
    if not cache_salt and lora is None:
        return ""
    return json.dumps({"cache_salt": cache_salt or "", "lora": list(lora) if lora else None},
                      sort_keys=True, separators=(",", ":"))


def fold_block_hashes(token_hashes: list[str], vllm_hashes: list[bytes]) -> list[str]:
    """One key hash per block from kvtier's chain and vLLM's: both chain over every block before,
    kvtier's seeded by the engine identity and the request salt, vLLM's folding the request's
    extra keys (LoRA, multimodal items, prompt embeddings, cache_salt).

    Args:
        token_hashes: :func:`kvtier.store.prefix.chained_block_hashes` of the blocks (hex).
        vllm_hashes: vLLM's ``request.block_hashes`` of the same blocks (bytes).
    """
    if len(token_hashes) != len(vllm_hashes):
        raise ValueError(f"token_hashes and vllm_hashes must have one entry per block; got "
                         f"{len(token_hashes)} and {len(vllm_hashes)}")
    out = []
    for t, v in zip(token_hashes, vllm_hashes):
        v = bytes(v)
        h = hashlib.blake2b(digest_size=HASH_BYTES, person=_PERSON_FOLD)
        h.update(bytes.fromhex(t))
        h.update(len(v).to_bytes(4, "little"))
        h.update(v)
        out.append(h.hexdigest())
    return out
