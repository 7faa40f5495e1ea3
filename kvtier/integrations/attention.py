"""kvtier's attention function: budgeted (sparse) attention over blocks chosen with the query.

transformers calls ``cache.update(k, v, layer)`` without the query, so the selection cannot
happen in the cache. Instead, in sparse mode a :class:`~kvtier.integrations.cache.TieredCache`
layer appends the new token in ``update`` and leaves a *pending* note; the model then calls this
function (registered as ``"kvtier"`` in transformers' ``AttentionInterface``, with ``sdpa_mask``
as its mask function), which sees the query and finishes the step:

```
 LlamaAttention.forward
   q, k, v = proj(h); rope
   cache.update(k, v, l)  ──► store.append(seq, l, k, v)        (sparse decode: returns k, v only)
   attention("kvtier")    ──► store.select(seq, l, q)           sinks + window + top-k by digest
                              store.gather_blocks(seq, l, sel)  swap-in from L2/L3 if needed
                              softmax(q K^T) V over those blocks  (one batched matmul, GQA packed)
                              store.observe(seq, l, sel, mass)  H2O mass from these weights
```
Anything that is not a pending sparse step of a TieredCache (another cache, a prefill) runs
transformers' own SDPA attention, so a model switched to ``"kvtier"`` still works with any cache.
"""
from __future__ import annotations

import math
import threading

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTN_IMPLEMENTATION = "kvtier"

# The TieredCache whose layer has a step pending, per thread: update() and the attention call
# of one layer happen back to back in the same thread.
_active = threading.local()


def set_active(cache) -> None:
    _active.cache = cache


def register() -> str:
    """Register kvtier's attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvtier_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def kvtier_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function (``attn_implementation="kvtier"``).

    Args:
        query: [batch, q_heads, q_len, head_dim]; key, value: [batch, kv_heads, kv_len, head_dim]
            (for a pending sparse step, only the new token's k, v: the cache holds the rest).
        attention_mask: boolean [batch|1, 1, q_len, kv_len_total] (True = attend) or None.
    Returns:
        ``(attn_output [batch, q_len, q_heads, head_dim], None)``.
    """
    cache = getattr(_active, "cache", None)
    layer_idx = getattr(module, "layer_idx", None)
    pending = cache.pending_for(layer_idx) if cache is not None else None
    if pending is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    _active.cache = None
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    if pending == "dense":
        out = sdpa_attention_forward(module, query, key, value, attention_mask,
                                     dropout=dropout, scaling=scaling, **kwargs)
        cache.after_dense_attention(layer_idx, query)
        return out
    return cache.sparse_attention(layer_idx, query, attention_mask, scaling), None


def attend_blocks(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with grouped KV heads, also returning each key's attention mass.

    The query heads sharing one KV head are packed into the query-length dimension, so K and V
    are never repeated: one batched matmul per product.

    Args:
        query: [B, q_heads, q_len, D]; keys, values: [B, kv_heads, n, D].
        mask: boolean [B, 1, q_len, n] (True = attend) or None.
    Returns:
        out: [B, q_len, q_heads, D] (the layout transformers expects);
        mass: float32 [B, n], attention weight per key summed over heads and queries.
    """
    b, qh, ql, d = query.shape
    kvh = keys.shape[1]
    g = qh // kvh
    # fp32 throughout: the budget keeps n small, and half-precision products lose logits' digits
    q = query.reshape(b, kvh, g * ql, d).float()  # [B, kv_heads, G*q_len, D] (head h uses kv head h // G)
    scores = torch.matmul(q, keys.float().transpose(-1, -2)) * scaling  # [B, kv_heads, G*q_len, n]
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        bias.masked_fill_(~mask, torch.finfo(torch.float32).min)  # [B, 1, q_len, n]
        scores = (scores.view(b, kvh, g, ql, -1) + bias.unsqueeze(2)).view(b, kvh, g * ql, -1)
    probs = torch.softmax(scores, dim=-1)  # [B, kv_heads, G*q_len, n]
    out = torch.matmul(probs, values.float())  # [B, kv_heads, G*q_len, D]
    out = out.view(b, qh, ql, d).transpose(1, 2).to(query.dtype).contiguous()  # [B, q_len, q_heads, D]
    return out, probs.sum(dim=(1, 2))  # mass: [B, n]
