"""The caches kvtier is measured against, and the helpers tests and benchmarks share.

Baselines are transformers' own: ``DynamicCache`` (the exact reference) and ``QuantizedCache``
with the quanto and HQQ backends (KIVI-style int4 with a full-precision residual window).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache, QuantizedCache
from transformers.cache_utils import Cache

__all__ = [
    "BASELINES",
    "cache_bytes",
    "greedy_generate",
    "make_baseline",
    "teacher_forced_logits",
    "token_agreement",
]

BASELINES = ("dynamic", "quanto-int4", "hqq-int4")


def make_baseline(kind: str, model, *, q_group_size: int = 64, residual_length: int = 128) -> Cache:
    """A fresh transformers cache for ``model``.

    Args:
        kind: ``"dynamic"``, ``"quanto-int4"``, ``"quanto-int2"``, ``"hqq-int4"``, ``"hqq-int8"``...
        q_group_size, residual_length: QuantizedCache parameters (transformers' defaults).
    """
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    backend, _, bits = kind.partition("-int")
    if backend in ("quanto", "hqq") and bits.isdigit():
        return QuantizedCache(backend=backend, config=model.config, nbits=int(bits),
                              q_group_size=q_group_size, residual_length=residual_length)
    raise ValueError(f"kind must be 'dynamic' or '<quanto|hqq>-int<bits>' (e.g. {BASELINES}); got {kind!r}")


def _tensor_bytes(obj, seen: set[int]) -> int:
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        # quanto's QTensor subclasses keep their data in inner tensors
        inner = getattr(obj, "__tensor_flatten__", None)
        if inner is not None and type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter:
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, n), seen) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(_tensor_bytes(v, seen) for k, v in vars(obj).items() if not k.startswith("__"))
    return 0


def cache_bytes(cache: Cache) -> int:
    """Bytes of tensors a transformers cache holds (quantized parts, scales and residuals included).

    For a TieredCache use ``cache.stats()["bytes"]`` instead (it knows its tiers).
    """
    return sum(_tensor_bytes(layer, set()) for layer in cache.layers)


def _greedy_kwargs(model) -> dict:
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.generation_config.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    return dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad)


@torch.inference_mode()
def greedy_generate(model, input_ids: torch.Tensor, cache: Cache, max_new_tokens: int,
                    attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """``model.generate`` through ``cache``; returns only the new tokens ``[batch, max_new_tokens]``.

    Greedy by default; pass ``do_sample=True`` (and seed torch) for sampling. EOS does not stop it
    (``min_new_tokens``), so runs are compared token for token.
    """
    gen = dict(_greedy_kwargs(model), min_new_tokens=max_new_tokens)
    gen.update(kwargs)
    out = model.generate(input_ids, attention_mask=attention_mask, cache=cache,
                         max_new_tokens=max_new_tokens, **gen)
    return out[:, input_ids.shape[1]:]


@torch.inference_mode()
def teacher_forced_logits(model, input_ids: torch.Tensor, cache: Cache, n_prefill: int,
                          attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill ``input_ids[:, :n_prefill]``, then feed the rest one token at a time (decode path).

    Args:
        attention_mask: optional ``[batch, T]`` padding mask (1 = token, 0 = left padding).
    Returns:
        float32 logits ``[batch, T - n_prefill + 1, vocab]``: the last prefill position, then every
        decode step.
    """
    def mask(t):
        return None if attention_mask is None else attention_mask[:, :t]

    def positions(t0, t1):
        if attention_mask is None:
            return None
        return (attention_mask[:, :t1].long().cumsum(-1) - 1).clamp(min=0)[:, t0:t1]

    out = model(input_ids=input_ids[:, :n_prefill], attention_mask=mask(n_prefill),
                position_ids=positions(0, n_prefill), cache=cache, use_cache=True)
    logits = [out.logits[:, -1].float()]
    for t in range(n_prefill, input_ids.shape[1]):
        out = model(input_ids=input_ids[:, t:t + 1], attention_mask=mask(t + 1),
                    position_ids=positions(t, t + 1), cache=cache, use_cache=True)
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits, dim=1)


def token_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of positions where two token tensors of the same shape agree."""
    if a.shape != b.shape:
        raise ValueError(f"token tensors must have the same shape; got {tuple(a.shape)} and {tuple(b.shape)}")
    return (a == b).float().mean().item()
