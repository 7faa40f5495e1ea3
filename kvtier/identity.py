"""What made a stored block: the identity every shared key is derived from.

A block leaves its sequence (prefix sharing, L3 adoption after a restart, L4, a saved
conversation, the vLLM connector) under a key seeded by :func:`kvtier.store.prefix.model_fingerprint_key`.
This module computes the model half of that seed, once per model:

```
 model identity = H( class, KV-relevant config (architecture, RoPE scaling, window, ...),
                     weights digest,                      every parameter and buffer
                     adapters )                           PEFT/LoRA names active, enabled
 weights digest = H( for each tensor, by name:
                       name, shape, dtype,
                       sum of its bytes as 64-bit words (every byte read once),
                       the exact bytes of SAMPLE elements at seeded positions )
```

What the weights digest provably detects: any change of a tensor's name, shape or dtype; any
change confined to one element of a tensor (its bytes change, so the wrapping sum of the
tensor's bytes read as 64-bit words moves by a non-zero amount); any change at a sampled position.
A fine-tune, a merged LoRA (``W + BA`` changes essentially every entry of ``W``) or a rescaled
layer changes many elements at once: it escapes only if the bit-pattern deltas of every changed
tensor sum to zero *and* no changed element is sampled — not a realistic accident, but not a
cryptographic guarantee either: the digest is a checksum against mistakes, not against an
adversary who crafts weights to collide.

Cost: one read of every weight (a reduction at memory bandwidth: ~0.1 s for SmolLM2-135M on a
2-core CPU; an 8B model on a GPU ~10 ms; see ``docs/identity.md``), memoized per model object
and recomputed only when a parameter is replaced or modified in place (torch's per-tensor
version counter). Weights that cannot be read (the meta device, offloaded to disk by
accelerate) give no digest, and then nothing is shared.
"""
from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections.abc import Iterable

import torch

__all__ = ["SAMPLE", "weights_digest", "model_identity", "identity_of", "config_identity",
           "adapter_identity", "NoIdentity"]

SAMPLE = 64  # elements read exactly from each tensor at seeded positions
_PERSON = b"kvtier-wts-v2"

# config keys that say how a model was loaded, not what it computes
_VOLATILE_CONFIG_KEYS = frozenset({
    "_name_or_path", "_commit_hash", "_attn_implementation", "_attn_implementation_autoset",
    "attn_implementation", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "_experts_implementation",
    # differ between a GGUF load and a safetensors load of the same weights; a quantized load
    # has other weights, which the digest sees
    "architectures", "quantization_config",
})

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class NoIdentity(ValueError):
    """The model's weights cannot be read (meta device, offloaded): nothing may be shared."""


def _tensor_summary(name: str, t: torch.Tensor) -> bytes:
    """name, shape, dtype, the wrapping sum of its bytes as 64-bit words, and SAMPLE exact elements."""
    if t.device.type == "meta":
        raise NoIdentity(f"weight {name!r} is on the meta device (offloaded or not loaded)")
    t = t.detach()
    if t.is_quantized:  # its integers, and the scales and zero points that give them meaning
        if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            params = json.dumps([str(t.qscheme()), t.q_scale(), t.q_zero_point()]).encode()
        else:
            params = (_tensor_summary(f"{name}:scales", t.q_per_channel_scales())
                      + _tensor_summary(f"{name}:zero_points", t.q_per_channel_zero_points())
                      + str(t.q_per_channel_axis()).encode())
        return params + _tensor_summary(f"{name}:{t.dtype}", t.int_repr())
    if t.is_sparse or t.layout != torch.strided:
        t = t.to_dense()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.contiguous().reshape(-1)
    n = flat.numel()
    head = json.dumps([name, list(t.shape), str(t.dtype).removeprefix("torch.")]).encode()
    if n == 0:
        return head
    view = flat.view(_INT_VIEW.get(flat.element_size(), torch.uint8))
    # the bytes summed as int64 words (wrapping): one changed element changes at least one word
    # by a non-zero amount mod 2**64; words are the fastest reduction whatever the dtype
    raw = view.view(torch.uint8)
    if raw.storage_offset() % 8:  # a word view needs aligned storage
        raw = raw.clone()
    whole = raw.numel() // 8 * 8
    total = int(raw[:whole].view(torch.int64).sum()) + int(raw[whole:].sum(dtype=torch.int64))
    total &= (1 << 64) - 1
    # positions from a generator seeded by the tensor's name and size: the same on every machine
    seed = int.from_bytes(hashlib.blake2b(head, digest_size=8).digest(), "little") & ((1 << 63) - 1)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (min(SAMPLE, n),), generator=gen)
    picked = view[idx.to(view.device)].cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return head + total.to_bytes(8, "little") + picked


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A 32-hex-digit digest of a model's weights (see the module docstring for what it detects).

    Args:
        named_tensors: ``(name, tensor)`` pairs, e.g. ``model.named_parameters()`` plus
            ``model.named_buffers()``; their order does not matter.
    Raises:
        NoIdentity: a tensor is on the meta device.
    """
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    seen = set()
    for name, t in sorted(named_tensors, key=lambda nt: nt[0]):
        if name in seen:
            raise ValueError(f"named_tensors must name each tensor once; {name!r} came twice")
        seen.add(name)
        with torch.no_grad():
            try:
                s = _tensor_summary(name, t)
            except (RuntimeError, TypeError, NotImplementedError) as e:
                # a tensor whose bytes cannot be viewed here (a torch-quantized or distributed
                # tensor, an unusual layout): what cannot be named is not shared
                raise NoIdentity(f"weight {name!r} cannot be read ({type(e).__name__}: {e})") from None
        h.update(len(s).to_bytes(4, "little"))
        h.update(s)
    return h.hexdigest()


def config_identity(config) -> dict:
    """The KV-relevant part of a transformers config (architecture, RoPE scaling, sliding
    window, attention scale, ...): everything but how it was loaded."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return {k: v for k, v in cfg.items() if k not in _VOLATILE_CONFIG_KEYS}


def adapter_identity(model) -> dict:
    """Which PEFT adapters shape the forward: their names, whether they are enabled, and their
    configs. Their weights are parameters of the model, so the weights digest covers them."""
    out = {}
    peft = getattr(model, "peft_config", None)
    if peft:
        out["peft_config"] = {name: (c.to_dict() if hasattr(c, "to_dict") else str(c)) for name, c in peft.items()}
        active = getattr(model, "active_adapters", None)
        try:
            active = active() if callable(active) else active
        except (ValueError, RuntimeError):  # transformers raises when adapters are disabled
            active = None
        out["active"] = sorted(active) if isinstance(active, (list, tuple, set)) else active
        out["disabled"] = bool(getattr(model, "_adapters_disabled", False))
    # PEFT's tuner layers carry the switches themselves (``with model.disable_adapter():``,
    # ``set_adapter``) without a change to any weight: their states are part of what computes
    layers = set()
    for m in model.modules():
        if hasattr(m, "disable_adapters") and hasattr(m, "active_adapters"):
            active = m.active_adapters
            layers.add((bool(m.disable_adapters), tuple(sorted(active)) if isinstance(active, (list, tuple, set))
                        else str(active)))
    if layers:
        out["layers"] = sorted(layers)
    return out


class _Memo:
    """Per model object: the identity, and the (tensor, version) pairs it was computed from."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_model: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


_memo = _Memo()


def _state(model) -> tuple:
    # a replaced tensor changes its id and data pointer; an in-place change bumps its version
    return tuple((name, id(t), t.data_ptr() if t.device.type != "meta" else 0, t._version)
                 for name, t in _named_tensors(model))


def _named_tensors(model) -> list[tuple[str, torch.Tensor]]:
    out = list(model.named_parameters())
    out += [(f"buffer:{n}", b) for n, b in model.named_buffers()]
    return out


def identity_of(model_class: str, config: dict, weights: str, adapters: dict) -> str:
    """``"<model_type>-<32 hex digits>"`` naming a model class, its KV-relevant config, its
    weights digest and its adapters (the pure part of :func:`model_identity`)."""
    payload = json.dumps({"class": model_class, "config": config, "weights": weights,
                          "adapters": adapters}, sort_keys=True, default=str)
    digest = hashlib.blake2b(payload.encode("utf-8"), digest_size=16, person=_PERSON).hexdigest()
    return f"{config.get('model_type', 'model')}-{digest}"


def model_identity(model) -> str:
    """The identity of what ``model`` computes, ``"<model_type>-<32 hex digits>"``, or ``""``
    when its weights cannot be read (then nothing of it is shared or loaded from storage).

    Independent of where and how the weights were loaded (GGUF or safetensors, device, attention
    backend); changed by any fine-tune, merged or active adapter, or KV-relevant config change.
    Memoized per model object (recomputed after a weight is modified or replaced).
    """
    # adapters switch on and off without a weight changing: their state is part of the memo's key
    adapters = adapter_identity(model)
    state = (_state(model), json.dumps(adapters, sort_keys=True, default=str))
    with _memo.lock:
        hit = _memo.by_model.get(model)
        if hit is not None and hit[0] == state:
            return hit[1]
    try:
        weights = weights_digest(_named_tensors(model))
    except NoIdentity:
        ident = ""
    else:
        ident = identity_of(type(model).__name__, config_identity(model.config), weights, adapters)
    with _memo.lock:
        _memo.by_model[model] = (state, ident)
    return ident
