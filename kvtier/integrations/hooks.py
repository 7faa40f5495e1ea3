"""The model side of kvtier's transformers integration: its attention switched to ``"kvtier"``,
and two hooks on its forward that give a :class:`~kvtier.integrations.cache.TieredCache` what
transformers does not pass to a cache:

```
 pre-hook   forward(input_ids, cache=c)  ──► c.set_input_ids(input_ids)   (content-addressed keys)
 post-hook  (always_call: also when the forward raised)
                                         ──► c._forward_ended(failed)     (a failed step rolled back)
```
"""
from __future__ import annotations

import torch

from . import attention as _attn


def switch_attention(model) -> None:
    """Register kvtier's attention and make ``model`` use it (previous choice kept for :func:`detach`).

    Without a TieredCache hand-over, kvtier's attention is the model's own (eager for an eager
    model, else SDPA: :func:`kvtier.integrations.attention.base_attention`), so the switched
    model still runs with any cache, rounding as before."""
    current = model.config._attn_implementation
    name = _attn.register(current)
    if current not in (_attn.ATTN_IMPLEMENTATION, _attn.ATTN_IMPLEMENTATION_EAGER):
        model._kvtier_previous_attn = current
        model.set_attn_implementation(name)


def _forward_cache(kwargs: dict):
    from .cache import TieredCache  # the cache module imports this one

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache if isinstance(cache, TieredCache) else None


def _ids_hook(module, args, kwargs):
    cache = _forward_cache(kwargs)
    if cache is not None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
            # padded rows: positions shift with the padding, so the same ids need not mean the
            # same K/V; such a cache stops giving ids (its blocks keep process-local keys)
            ids = None
        cache.set_input_ids(ids if isinstance(ids, torch.Tensor) else None)
    return None


def _end_hook(module, args, kwargs, result):
    # always_call: runs after a forward that raised too (result None), so its step is rolled back
    cache = _forward_cache(kwargs)
    if cache is not None:
        cache._forward_ended(failed=result is None)
    return None


def register_hooks(model) -> None:
    if getattr(model, "_kvtier_ids_hook", None) is None:
        model._kvtier_ids_hook = model.register_forward_pre_hook(_ids_hook, with_kwargs=True)
    if getattr(model, "_kvtier_end_hook", None) is None:
        model._kvtier_end_hook = model.register_forward_hook(_end_hook, with_kwargs=True, always_call=True)


def detach(model) -> None:
    """Give ``model`` back the attention implementation it had before :func:`attach`."""
    for name in ("_kvtier_ids_hook", "_kvtier_end_hook"):
        hook = getattr(model, name, None)
        if hook is not None:
            hook.remove()
            setattr(model, name, None)
    prev = getattr(model, "_kvtier_previous_attn", None)
    if prev is not None:
        model.set_attn_implementation(prev)
        del model._kvtier_previous_attn
