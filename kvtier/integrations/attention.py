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
                              store.gather_view(seq, l, sel)    swap-in from L2/L3 if needed; views of L1
                              softmax(q K^T) V over those blocks  (one batched matmul, GQA packed)
                              store.observe(seq, l, order, mass) H2O mass from these weights
```
A multi-token step of a TieredCache over tokens already cached (a prefill after
``load_prefix``, a chunked prefill), in dense or sparse mode, whose mask is exactly causal with an
offset (no padding, every batch row alike) is split in two unmasked passes instead of one SDPA over
an explicit ``[q_len, past + q_len]`` mask, and the two are merged exactly with their log-sum-exp:

```
            keys:  0 ......... past-1 | past ........ past+q-1
 query i:          all attended       | causal: keys past..past+i
                   pass 1: no mask    | pass 2: is_causal=True (q_len == kv_len)
                   (GQA packed)       |
 out = w1 * out1 + (1 - w1) * out2,   w1 = sigmoid(lse1 - lse2)
```
Everything else (another cache, a first prefill, padding, any other mask, decode) runs
transformers' own SDPA attention, so a model switched to ``"kvtier"`` still works with any cache.
"""
from __future__ import annotations

import math
import threading
import weakref

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


# CPU kernel returning (out, logsumexp); absent in old torch builds (then: masked SDPA)
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_SPLIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    pending = cache.pending_for(layer_idx, key) if cache is not None else None
    if pending is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    _active.cache = None
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    if pending == "sparse":
        return cache.sparse_attention(layer_idx, query, attention_mask, scaling), None
    # "split" (dense mode) or "dense" (a multi-token step in sparse mode)
    if _splittable(module, query, key, value, attention_mask, dropout, kwargs):
        out = split_prefix_attention(query, key, value, key.shape[2] - query.shape[2], scaling), None
    else:
        out = sdpa_attention_forward(module, query, key, value, attention_mask,
                                     dropout=dropout, scaling=scaling, **kwargs)
    if pending == "dense":
        cache.after_dense_attention(layer_idx, query)
    return out


def _splittable(module, query, key, value, attention_mask, dropout, kwargs) -> bool:
    """Whether this call may run as :func:`split_prefix_attention` and give SDPA's result."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if not 1 < q_len < kv_len or dropout or not getattr(module, "is_causal", True):
        return False
    if kwargs.get("is_causal") is False or any(
            kwargs.get(k) is not None for k in ("position_bias", "softcap", "sliding_window", "s_aux")):
        return False
    if query.dtype not in _SPLIT_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype \
            or key.shape[-1] != value.shape[-1] or query.shape[1] % key.shape[1]:
        return False
    if query.device.type == "cpu":
        if _CPU_FLASH is None:
            return False
    elif query.device.type != "cuda" or query.shape[-1] % 8:
        return False
    return _offset_causal(attention_mask, q_len, kv_len)


def _offset_causal(mask: torch.Tensor | None, q_len: int, kv_len: int) -> bool:
    """Whether boolean ``mask`` [B|1, 1, q_len, kv_len] lets query i attend exactly keys
    [0, past + i] (past = kv_len - q_len) in every row: no padding, no window, nothing else.

    Checked once per mask: transformers builds one mask per forward and hands the same tensor to
    every layer, so the answer is kept (per thread) for as long as that tensor lives.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4 \
            or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (q_len, kv_len):
        return False
    memo = getattr(_active, "mask_memo", None)
    if memo is not None and memo[0]() is mask:
        return memo[1]
    past = kv_len - q_len
    tril = torch.ones(q_len, q_len, dtype=torch.bool, device=mask.device).tril_()  # [q_len, q_len]
    ok = bool(mask[..., :past].all()) and torch.equal(mask[..., past:], tril.expand(mask.shape[0], 1, q_len, q_len))
    _active.mask_memo = (weakref.ref(mask), ok)
    return ok


def _attention_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its log-sum-exp without a [q, k] matrix (same head count in q and k).

    Args:
        query: [B, H, q, D]; key, value: [B, H, k, D]. ``causal``: upper-left aligned, so only
            meant for q == k.
    Returns:
        out [B, H, q, D] in query's dtype; lse float32 [B, H, q] (natural log of the softmax
        denominator of the scaled scores).
    """
    if query.device.type == "cpu":
        out, lse = _CPU_FLASH(query, key, value, 0.0, causal, scale=scaling)
        return out, lse
    # CUDA: the memory-efficient kernel takes every dtype kvtier uses; its lse is padded to a
    # multiple of 32 queries
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, 0.0, causal, scale=scaling)
    return out, lse[:, :, : query.shape[2]]


def split_prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: int,
                           scaling: float) -> torch.Tensor:
    """Causal attention of ``q_len`` new tokens over ``past`` cached ones and themselves, as
    SDPA with the offset causal mask computes it, in two unmasked passes merged by log-sum-exp.

    Pass 1 attends every new query to the cached keys (no mask: all of them are visible; the
    query heads sharing a KV head are packed into the query length, so K and V are not repeated).
    Pass 2 attends the new queries to the new keys with ``is_causal`` (square: upper-left
    alignment is right). With l1, l2 the log-sum-exps of the two passes, the full softmax weighs
    them by exp(l1) and exp(l2), hence out = w1 * out1 + (1 - w1) * out2, w1 = sigmoid(l1 - l2).

    Args:
        query: [B, q_heads, q_len, D]; key, value: [B, kv_heads, past + q_len, D].
        past: tokens before this step (>= 1).
    Returns:
        [B, q_len, q_heads, D] (the layout transformers expects), in query's dtype, rounded once
        from float32 (as SDPA rounds its float32 accumulation once).
    """
    b, qh, ql, d = query.shape
    kvh = key.shape[1]
    g = qh // kvh
    assert key.shape[2] == past + ql and past > 0, f"key length {key.shape[2]} != past {past} + q_len {ql}"
    dtype = query.dtype
    # Both passes in float32: in fp16/bf16 each pass would round its output before the merge
    # rounds again, about 1.3x SDPA's RMS error and 2x its worst element on SmolLM2's own
    # queries; in float32 one rounding remains, at the end, as in SDPA.
    query, key, value = query.float(), key.float(), value.float()
    qp = query.reshape(b, kvh, g * ql, d)  # [B, kv_heads, G*q_len, D] (head h uses kv head h // G)
    out1, lse1 = _attention_lse(qp, key[:, :, :past], value[:, :, :past], False, scaling)
    out1 = out1.reshape(b, qh, ql, d)  # [B, q_heads, q_len, D]
    lse1 = lse1.reshape(b, qh, ql)  # [B, q_heads, q_len]
    k_new, v_new = key[:, :, past:], value[:, :, past:]  # [B, kv_heads, q_len, D]
    if g > 1:
        k_new = k_new[:, :, None].expand(b, kvh, g, ql, d).reshape(b, qh, ql, d)  # [B, q_heads, q_len, D]
        v_new = v_new[:, :, None].expand(b, kvh, g, ql, d).reshape(b, qh, ql, d)
    out2, lse2 = _attention_lse(query, k_new, v_new, True, scaling)
    w1 = torch.sigmoid(lse1 - lse2).unsqueeze(-1)  # [B, q_heads, q_len, 1], float32
    out = torch.lerp(out2, out1, w1)  # out2 + w1 * (out1 - out2)
    return out.to(dtype).transpose(1, 2).contiguous()  # [B, q_len, q_heads, D]


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
