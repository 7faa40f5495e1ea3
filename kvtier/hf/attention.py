"""kvtier's attention function: what a TieredCache layer hands over, finished with the query.

transformers calls ``cache.update(k, v, layer)`` without the query, so whatever needs the query
happens here. A :class:`~kvtier.hf.cache.TieredCache` layer that needs this call puts a
:class:`~kvtier.hf.handover.Handover` into the attention kwargs (the dict transformers
passes to ``update`` and then to this function); this function, registered as ``"kvtier"`` in
transformers' ``AttentionInterface`` (with ``sdpa_mask`` as its mask function), claims it and
finishes the layer's step:

```
 LlamaAttention.forward
   q, k, v = proj(h); rope
   cache.update(k, v, l)  ──► store.append(seq, l, k, v)   (sparse decode: returns k, v only)
   attention("kvtier")    ──► Handover.claim(l, k)
     SPARSE: sparse.budgeted_attention     select + gather_view + attend over the chosen blocks
     DENSE:  SDPA (or split), then seed H2O/SnapKV from the last queries
     SPLIT:  split_prefix_attention when the mask is exactly causal, else SDPA
```
A multi-token step of a TieredCache over tokens already cached (a prefill after
``load_prefix``, a chunked prefill, a speculative verification), in dense or sparse mode, whose
mask is exactly causal with an offset (no padding, every batch row alike) is split in two
unmasked passes instead of one SDPA over an explicit ``[q_len, past + q_len]`` mask, and the two
are merged exactly with their log-sum-exp:

```
            keys:  0 ......... past-1 | past ........ past+q-1
 query i:          all attended       | causal: keys past..past+i
                   pass 1: no mask    | pass 2: is_causal=True (q_len == kv_len)
                   (GQA packed)       |
 out = w1 * out1 + (1 - w1) * out2,   w1 = sigmoid(lse1 - lse2)
```
Everything else (another cache, a first prefill, padding, any other mask, decode) runs the
model's own attention (:func:`base_attention`), so a model switched to kvtier's attention still
works with any cache. Two names are registered, one per attention a model may come with:
``"kvtier"`` over SDPA (``sdpa_mask``: boolean masks) and ``"kvtier_eager"`` over the modeling
module's ``eager_attention_forward`` (``eager_mask``: additive float masks), so that switching
changes no rounding. With ``attention_math="sdpa"`` (the default) nothing is split and the sparse
step calls that same attention (on the blocks it selected), so a lossless cache attending
everything reproduces ``DynamicCache``'s tokens exactly (see ``KVTierConfig.attention_math``).

``output_attentions=True``: dense mode returns the base attention's weights (eager: its own; over
SDPA, which has none, the eager formula's, computed only when asked); sparse mode refuses at the
first step with a ValueError, since a budgeted step attends a subset whose weights would not be
the model's.
"""
from __future__ import annotations

import math
import sys
import threading
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

from .handover import HANDOVER_KWARG, StepKind

ATTN_IMPLEMENTATION = "kvtier"  # over SDPA
ATTN_IMPLEMENTATION_EAGER = "kvtier_eager"  # over the model's eager attention
#: the implementation kvtier's attention replaces -> the name it registers for it
KVTIER_NAMES = {"eager": ATTN_IMPLEMENTATION_EAGER}

# _offset_causal's answer for the mask tensor it last checked, per thread (a pure function of
# that tensor, which transformers hands to every layer of one forward)
_mask_memo = threading.local()


# CPU kernel returning (out, logsumexp); absent in old torch builds (then: masked SDPA)
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_SPLIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def register(base: str | None = None) -> str:
    """Register kvtier's attention and mask functions with transformers (idempotent); returns
    the name that replaces attention implementation ``base`` (``"eager"``: the eager one; any
    other: the one over SDPA)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvtier_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    AttentionInterface.register(ATTN_IMPLEMENTATION_EAGER, kvtier_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION_EAGER, eager_mask)
    return KVTIER_NAMES.get(base, ATTN_IMPLEMENTATION)


def _eager_base(module: torch.nn.Module) -> bool:
    config = getattr(module, "config", None)
    return getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION_EAGER


def _eager_function(module: torch.nn.Module):
    """The modeling module's own ``eager_attention_forward`` (models differ: softcapping, sinks)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True = attend) as eager attention takes it: 0 or dtype's min, added to
    the scores (what ``eager_mask`` makes); a float mask is returned as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def base_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, *, scaling: float | None, dropout: float = 0.0,
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention the model had before kvtier's replaced it: its eager function for a model
    switched as ``"kvtier_eager"``, else transformers' SDPA; with ``output_attentions`` over SDPA,
    the weights of the eager formula as well (SDPA has none to give).

    Args:
        query: [batch, q_heads, q_len, head_dim]; key, value: [batch, kv_heads, kv_len, head_dim].
        attention_mask: [batch|1, 1, q_len, kv_len], boolean (True = attend) or additive float.
    Returns:
        ``(out [batch, q_len, q_heads, head_dim], weights [batch, q_heads, q_len, kv_len] or None)``.
    """
    if _eager_base(module):
        if attention_mask is None and query.shape[2] > 1:
            # an eager mask is never skipped for a causal prefill; this one came from elsewhere
            q, kv = query.shape[2], key.shape[2]
            attention_mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril_(kv - q)[None, None]
        return _eager_function(module)(module, query, key, value, additive_mask(attention_mask, query.dtype),
                                       scaling=scaling, dropout=dropout, **kwargs)
    want = kwargs.pop("output_attentions", False)  # SDPA would only warn that it has no weights
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                    scaling=scaling, **kwargs)
    if not want:
        return out, None
    mask = attention_mask
    if mask is None and query.shape[2] > 1:  # SDPA ran is_causal: the same, explicitly
        q, kv = query.shape[2], key.shape[2]
        mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril_(kv - q)[None, None]
    _, weights = _eager_function(module)(module, query, key, value, additive_mask(mask, query.dtype),
                                         scaling=scaling, dropout=0.0)
    return out, weights


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
        ``(attn_output [batch, q_len, q_heads, head_dim], weights or None)`` (weights only for
        ``output_attentions``: :func:`base_attention`).
    """
    hand = kwargs.pop(HANDOVER_KWARG, None)
    kind = hand.claim(getattr(module, "layer_idx", None), key) if hand is not None else None
    if kind is None:
        return base_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                              **kwargs)
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    cache = hand.cache
    if kwargs.get("output_attentions") and cache.config.attention == "sparse":
        raise ValueError("output_attentions=True needs attention='dense' with a TieredCache: a sparse "
                         "(budgeted) step attends only the blocks it selects, so it has no weights "
                         "over the whole context to return")
    if kind is StepKind.SPARSE:
        return cache.sparse_attention(hand.layer, query, attention_mask, scaling, module), None
    if cache.config.attention_math != "sdpa" and not kwargs.get("output_attentions") \
            and _splittable(module, query, key, value, attention_mask, dropout, kwargs):
        out = split_prefix_attention(query, key, value, key.shape[2] - query.shape[2], scaling), None
    else:
        out = base_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                             **kwargs)
    if kind is StepKind.DENSE:
        cache.after_dense_attention(hand.layer, query)
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
    memo = getattr(_mask_memo, "last", None)
    if memo is not None and memo[0]() is mask:
        return memo[1]
    past = kv_len - q_len
    tril = torch.ones(q_len, q_len, dtype=torch.bool, device=mask.device).tril_()  # [q_len, q_len]
    ok = bool(mask[..., :past].all()) and torch.equal(mask[..., past:], tril.expand(mask.shape[0], 1, q_len, q_len))
    _mask_memo.last = (weakref.ref(mask), ok)
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


def decode_attention_lse(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scaling: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One decode step's unmasked attention over ``key``/``value`` and its log-sum-exp, in one
    kernel (CPU flash attention), for a sparse step that leaves blocks out: what
    :func:`base_attention` computes over SDPA, to float rounding, plus the log-sum-exp the
    estimate of the rest merges with, which SDPA does not return.

    The query heads sharing a KV head are packed into the query length, so K and V are read
    once per KV head: for bfloat16 that is also ~8x faster than SDPA's kernel, which at one
    query per head re-reads and converts each KV head's keys for every query head sharing it.

    Args:
        query: [1, q_heads, 1, head_dim]; key, value: [1, kv_heads, n, head_dim], the query's dtype.
    Returns:
        ``(out [1, 1, q_heads, head_dim] contiguous, lse float32 [q_heads])``, or None where this
        call is not SDPA's (the module's eager function, CUDA, a batch, another shape or dtype):
        the caller takes :func:`base_attention`.
    """
    b, qh, ql, d = query.shape
    if (_CPU_FLASH is None or b != 1 or ql != 1 or query.device.type != "cpu" or _eager_base(module)
            or query.dtype not in _SPLIT_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype
            or key.dim() != 4 or key.shape[0] != 1 or key.shape[-1] != d or value.shape != key.shape
            or qh % key.shape[1] or key.shape[2] == 0):
        return None
    kvh = key.shape[1]
    out, lse = _CPU_FLASH(query.reshape(1, kvh, qh // kvh, d), key, value, 0.0, False, scale=scaling)
    return out.reshape(1, 1, qh, d).contiguous(), lse.reshape(qh).contiguous()


def decode_attention_fused(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           scaling: float, mass: bool, rest: tuple[torch.Tensor, torch.Tensor] | None,
                           mass_len: int = 0) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """:func:`decode_attention_lse` and what a sparse step does with its result, in one compiled
    pass (``score_cpu.decode_attend``): the exact part over the gathered keys, merged with the
    estimate ``rest`` of the blocks left out (None: none), and with ``mass`` each gathered key's
    attention mass for H2O (what :func:`kvtier.hf.sparse.key_mass` computes). For the step's
    sizes (one query, a few hundred to a few thousand keys) the flash kernel's blocking costs
    more than the arithmetic, and the mass pass reads the keys a second time.

    Returns ``(out [1, 1, q_heads, head_dim], mass float32 [1, max(n, mass_len)] (zeros past n)
    or None)``, or None where
    :func:`decode_attention_lse` would not apply or the routine cannot (no compiler, float16):
    the caller takes that path.
    """
    b, qh, ql, d = query.shape
    if b != 1 or ql != 1 or query.device.type != "cpu" or _eager_base(module):
        return None
    from kvtier.store import score_cpu

    got = score_cpu.decode_attend(query, key, value, scaling, mass, rest, mass_len)
    if got is None:
        return None
    out, _, m = got
    return out, None if m is None else m.unsqueeze(0)


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

