"""The model side of kvtier's transformers integration: its attention switched to ``"kvtier"``,
and two hooks on its forward that give a cache that is a :class:`ForwardObserver` (a
:class:`~kvtier.hf.cache.TieredCache`) what transformers does not pass to a cache:

```
 pre-hook   forward(input_ids, cache=c)  ──► c.check_model(model)        (the identity it stores under)
                                         ──► c.set_input_ids(input_ids)   (content-addressed keys)
 post-hook  (always_call: also when the forward raised)
                                         ──► c.forward_ended(failed)      (a failed step rolled back)
```
"""
from __future__ import annotations

import torch

from . import attention as _attn


def switch_attention(model) -> None:
    """Register kvtier's attention and make ``model`` use it (previous choice kept for :func:`detach`).

    Without a TieredCache hand-over, kvtier's attention is the model's own (eager for an eager
    model, else SDPA: :func:`kvtier.hf.attention.base_attention`), so the switched
    model still runs with any cache, rounding as before."""
    current = model.config._attn_implementation
    name = _attn.register(current)
    if current not in (_attn.ATTN_IMPLEMENTATION, _attn.ATTN_IMPLEMENTATION_EAGER):
        model._kvtier_previous_attn = current
        model.set_attn_implementation(name)


class ForwardObserver:
    """What a cache implements to be told about the forwards it serves: the hooks find it among a
    forward's arguments and call these. It is a transformers ``Cache`` too (the pre-hook reads
    ``layers[0].length`` for the positions it expects)."""

    def check_model(self, model) -> None:
        """Before a forward of ``model``: raise where its K/V must not be stored in this cache."""
        raise NotImplementedError

    def set_input_ids(self, input_ids: torch.Tensor | None) -> None:
        """Before a forward: its token ids ([batch, t]), or None where they alone do not name its K/V."""
        raise NotImplementedError

    def forward_ended(self, failed: bool) -> None:
        """After a forward, also one that raised (``failed``)."""
        raise NotImplementedError


def _forward_cache(kwargs: dict) -> ForwardObserver | None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache if isinstance(cache, ForwardObserver) else None


# forward arguments that change nothing a block's K/V depend on beyond its token ids (or whose
# effect is checked below): with any other input given (inputs_embeds, pixel_values, audio
# features, ...) the ids do not say what made the K/V, and the forward's blocks stay unshared
_KEYABLE_KWARGS = frozenset({
    "input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
    "cache_position", "logits_to_keep", "num_logits_to_keep", "return_dict", "output_attentions",
    "output_hidden_states", "labels",
})


def _keyable_ids(cache, args, kwargs):
    """The forward's ``input_ids`` if they alone name what its K/V depend on, else None."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or len(args) > 1:
        return None
    if any(v is not None for k, v in kwargs.items() if k not in _KEYABLE_KWARGS):
        return None
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        # padded rows: positions shift with the padding, so the same ids need not mean the
        # same K/V; such a cache stops giving ids (its blocks keep process-local keys)
        return None
    pos = kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor):
        # positions other than the cache's next ones change RoPE, and so the keys
        past = cache.layers[0].length if cache.layers else 0
        want = torch.arange(past, past + ids.shape[1], device=pos.device)
        if pos.shape[-1] != ids.shape[1] or not bool((pos.reshape(-1, pos.shape[-1]) == want).all()):
            return None
    return ids


def _ids_hook(module, args, kwargs):
    cache = _forward_cache(kwargs)
    if cache is not None:
        cache.check_model(module)
        cache.set_input_ids(_keyable_ids(cache, args, kwargs))
    return None


def _end_hook(module, args, kwargs, result):
    # always_call: runs after a forward that raised too (result None), so its step is rolled back
    cache = _forward_cache(kwargs)
    if cache is not None:
        cache.forward_ended(failed=result is None)
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
