"""Budgeted (sparse) attention of a one-token decode step over the blocks chosen with the query.

```
 per batch row:  store.select(seq, l, q)        sinks + window + top-k by key digest
                 store.gather_view(seq, l, sel)  swap-in from L2/L3 if needed; views of L1
 all rows:       stack (pad rows that attend fewer tokens, masked out)
                 softmax(q K^T) V                attention_math="sdpa" (default): the model's own
                                                 attention (SDPA or eager) on the gathered blocks, or,
                                                 when they are not all the blocks (one row, CPU, SDPA),
                                                 flash attention with its log-sum-exp;
                                                 "float32": one batched matmul, GQA packed, wider type
                 + the rest, estimated           rest_attention="estimate": the blocks not selected,
                                                 from their digests, merged by log-sum-exp
                 attention mass per block        for H2O (handed to the store at the step's end)
```
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from kvtier.store import KVStore, score_cpu

from .attention import base_attention, decode_attention_fused, decode_attention_lse


@dataclass
class SparseResult:
    out: torch.Tensor            # [batch, 1, q_heads, head_dim]
    attended: int                # tokens attended by the longest row
    selected_blocks: int         # sealed blocks selected over all rows (the open one not counted)
    observed: list               # (seq, layer, block order, mass per block) when observing, else []


def budgeted_attention(store: KVStore, seqs: list[int], layer: int, query: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float, budget_tokens: int,
                       observe: bool, sdpa_module: torch.nn.Module | None = None) -> SparseResult:
    """Attend each row's selected blocks.

    Args:
        query: [batch, q_heads, 1, head_dim]; attention_mask: bool [batch|1, 1, 1, T] or None.
        observe: collect the attention mass per block (H2O/SnapKV policies).
        sdpa_module: attend with this attention module's own attention (SDPA, or its eager
            function: :func:`.attention.base_attention`), in the KV dtype
            (``attention_math="sdpa"``), instead of :func:`attend_blocks`' wider type.
    """
    sels, ks, vs, ps, rests = [], [], [], [], []
    estimate = store.estimates_rest
    for row, seq in enumerate(seqs):
        if estimate:  # and the estimate of the blocks left out, (out, lse) or None
            sel, rest = store.select_with_rest(seq, layer, query[row], budget_tokens, scaling,
                                               _visible(attention_mask, row))
            rests.append(rest)
        else:
            sel = store.select(seq, layer, query[row], budget_tokens)  # query[row]: [q_heads, 1, head_dim]
        # views of L1 ([kv_heads, n, head_dim], pos [n]), valid until this layer's next store
        # call: consumed below (stacked/padded or attended) before that; sel: their block order
        k, v, pos, sel = store.gather_view(seq, layer, sel)
        sels.append(sel)
        ks.append(k)
        vs.append(v)
        ps.append(pos)
    lens = [p.numel() for p in ps]
    n = max(lens)
    if len(ks) == 1:
        k, v, pos = ks[0].unsqueeze(0), vs[0].unsqueeze(0), ps[0].unsqueeze(0)
    elif min(lens) == n:
        k, v, pos = torch.stack(ks), torch.stack(vs), torch.stack(ps)
    else:  # rows attend different counts: pad, and mask the padding out below
        kv_heads, head_dim = ks[0].shape[0], ks[0].shape[2]
        k = query.new_zeros((len(ks), kv_heads, n, head_dim), dtype=ks[0].dtype)
        v = torch.zeros_like(k)
        pos = torch.zeros((len(ks), n), dtype=torch.long, device=ps[0].device)
        for row, (kr, vr, pr) in enumerate(zip(ks, vs, ps)):
            k[row, :, : pr.numel()] = kr
            v[row, :, : pr.numel()] = vr
            pos[row, : pr.numel()] = pr
    if k.dtype != query.dtype:
        k, v = k.to(query.dtype), v.to(query.dtype)
    mask = None
    if attention_mask is not None:
        m = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        m = m.expand(len(ks), 1, m.shape[2], m.shape[3])  # [B, 1, q_len, T]
        idx = pos.to(m.device)[:, None, None, :].expand(-1, 1, m.shape[2], -1)  # [B, 1, q_len, n]
        mask = torch.gather(m, 3, idx)
    if min(lens) != n:
        valid = torch.arange(n, device=k.device)[None, :] < torch.tensor(lens, device=k.device)[:, None]
        valid = valid[:, None, None, :]  # [B, 1, 1, n]
        mask = valid if mask is None else mask & valid
    if sdpa_module is None:
        out, mass = attend_blocks(query, k, v, mask, scaling)  # out [B, 1, q_heads, D], mass [B, n]
    else:
        exact = fused = None
        if mask is None and len(seqs) == 1 and lens[0] < store.seq_len(seqs[0], layer):
            # blocks were left out, so the step is not full attention's and needs no bit-identity
            # with it: one compiled pass gives the exact part merged with the estimate (and the
            # mass), else one kernel the exact part and the log-sum-exp the estimate merges with
            fused = decode_attention_fused(sdpa_module, query, k, v, scaling, observe,
                                           rests[0] if rests else None, len(sels[0]) * store.block_tokens)
            if fused is None:
                exact = decode_attention_lse(sdpa_module, query, k, v, scaling)
        if fused is not None:
            out, mass = fused
            rests = [None]  # merged
        elif exact is None:
            # the call the model's attention over DynamicCache makes: with every block selected
            # (in order, so the gathered mask is the model's own; None stays None) the same
            # kernel sees the same inputs
            # k, v as gathered: views of the L1 region are strided (a narrowed run per head),
            # which SDPA reads in place with the same result as a contiguous copy, at half the time
            out = base_attention(sdpa_module, query, k, v, mask, scaling=scaling)[0]  # [B, 1, q_heads, D]
        else:
            out, lse = exact
            if rests and rests[0] is not None:
                rest_out, rest_lse = (t.contiguous() for t in rests[0])
                if not score_cpu.merge_lse(lse, rest_out, rest_lse, out):
                    out = merge_with_lse(lse.view(1, 1, -1), rests[0], out)
                rests = [None]  # merged
        if fused is None:
            # the mass ranks blocks (H2O): float32 is precise enough, the output does not use it
            mass = key_mass(query, k, mask, scaling) if observe else None
    if any(r is not None for r in rests):
        out = with_rest(query, k, mask, scaling, rests, out)
    observed = []
    if observe:
        bt = store.block_tokens
        for row, seq in enumerate(seqs):
            nb = len(sels[row])  # the gathered blocks in gather_view's order, the open one last
            mrow = mass[row]
            if mrow.numel() != nb * bt:  # the open block's empty tail (the fused pass's mass has it)
                mrow = torch.nn.functional.pad(mrow[: lens[row]], (0, nb * bt - lens[row]))
            # per block, the open one last; handed to the store at the end of the step, so
            # reading it back (a device sync on CUDA) happens once per step, not per layer
            observed.append((seq, layer, sels[row], mrow.view(nb, bt).sum(1)))
    return SparseResult(out, n, sum(len(s) - 1 for s in sels), observed)


def _visible(attention_mask: torch.Tensor | None, row: int) -> torch.Tensor | None:
    """The tokens the step's mask [B|1, 1, 1, T] (bool, or additive float) lets batch row
    ``row`` see, bool [T] on the CPU; None when it hides none (or there is no mask)."""
    if attention_mask is None:
        return None
    m = attention_mask[row if attention_mask.shape[0] > 1 else 0, 0, -1]
    m = m if m.dtype == torch.bool else m == 0
    return None if bool(m.all()) else m.cpu()


def with_rest(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, scaling: float,
              rests: list, out: torch.Tensor) -> torch.Tensor:
    """``out``, the exact attention over the gathered blocks, merged with each row's estimate of
    the attention over the blocks the step left out (``rest_attention="estimate"``).

    Two softmaxes over disjoint keys merge exactly by their log-sum-exps l1, l2: the full
    softmax gives the first part the weight exp(l1) / (exp(l1) + exp(l2)) = sigmoid(l1 - l2).

    Args:
        query: [B, q_heads, 1, head_dim]; keys: the gathered keys [B, kv_heads, n, head_dim];
        mask: their mask [B, 1, 1, n] or None; rests: per row, ``(out [q_heads, 1, head_dim],
        lse [q_heads, 1])`` of the estimate, or None; out: [B, 1, q_heads, head_dim].
    """
    if mask is None and len(rests) == 1 and out.is_contiguous():
        # a decode step's case on the CPU: one compiled pass (score_cpu.merge_rest), in place
        rest_out, rest_lse = rests[0]
        if score_cpu.merge_rest(query, keys, scaling, rest_out.contiguous(), rest_lse.contiguous(), out):
            return out
    b, qh, ql, d = query.shape
    kvh = keys.shape[1]
    q = query.reshape(b, kvh, qh // kvh * ql, d).float()
    logits = torch.matmul(q, keys.float().transpose(-1, -2)) * scaling  # [B, kv_heads, G*q_len, n]
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))  # mask [B, 1, 1, n]: q_len is 1
    lse = torch.logsumexp(logits, dim=-1).view(b, qh, ql).transpose(1, 2)  # [B, q_len, q_heads]
    merged = out.float()
    for row, r in enumerate(rests):
        if r is not None:
            merged[row] = _lerp_rest(lse[row], r, merged[row])
    return merged.to(out.dtype)


def _lerp_rest(lse: torch.Tensor, rest: tuple, out: torch.Tensor) -> torch.Tensor:
    """One row's merge: ``out`` float32 [q_len, q_heads, D] with its log-sum-exp ``lse``
    [q_len, q_heads], and the estimate ``rest`` = (out [q_heads, q_len, D], lse [q_heads, q_len])."""
    rest_out, rest_lse = rest[0].transpose(0, 1), rest[1].transpose(0, 1)  # [q_len, q_heads, (D)]
    w = torch.sigmoid(lse - rest_lse).unsqueeze(-1)  # the exact part's share
    return torch.lerp(rest_out, out, w)


def merge_with_lse(lse: torch.Tensor, rest: tuple, out: torch.Tensor) -> torch.Tensor:
    """``out`` [1, 1, q_heads, D] (the exact part, log-sum-exp ``lse`` [1, 1, q_heads]) merged with
    the estimate ``rest``: :func:`with_rest` when the exact part's log-sum-exp is known (torch
    form of ``score_cpu.merge_lse``)."""
    return _lerp_rest(lse[0], rest, out[0].float()).unsqueeze(0).to(out.dtype)


def key_mass(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Each key's attention mass summed over heads and queries, float32 [B, n]:
    ``attention_probs(..., wide=False).sum(dim=(1, 2))``, by the compiled routine where it
    applies (one batch row, no mask, CPU keys: a decode step's case; ``score_cpu.key_mass``)."""
    if mask is None:
        m = score_cpu.key_mass(query, keys, scaling)
        if m is not None:
            return m.unsqueeze(0)
    return attention_probs(query, keys, mask, scaling, wide=False).sum(dim=(1, 2))


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
    probs = attention_probs(query, keys, mask, scaling)  # [B, kv_heads, G*q_len, n]
    out = torch.matmul(probs, values.to(probs.dtype))  # [B, kv_heads, G*q_len, D]
    out = out.view(b, qh, ql, d).transpose(1, 2).to(query.dtype).contiguous()  # [B, q_len, q_heads, D]
    return out, probs.sum(dim=(1, 2)).float()  # mass: [B, n]


def attention_probs(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None,
                    scaling: float, wide: bool = True) -> torch.Tensor:
    """softmax(q K^T * scaling) with grouped KV heads (shapes as in :func:`attend_blocks`),
    computed in a wider type than the KV's: float32 for fp16/bf16, and on CPU float64 for
    float32 (a GPU's float64 can be tens of times slower: there float32 stays float32);
    ``wide=False``: float32 throughout.

    Returns:
        [B, kv_heads, G*q_len, n]: row ``g * q_len + i`` of kv head h is query head ``h * G + g``
        (GQA groups consecutive query heads), query ``i``.
    """
    b, qh, ql, d = query.shape
    kvh = keys.shape[1]
    g = qh // kvh
    # wider than the inputs throughout, the output rounded once at the end (the budget keeps n
    # small): half-precision products lose logits' digits, and float32 ones leave an fp32 model's
    # output with a few roundings more than SDPA's kernel (up to twice its RMS error against a
    # float64 computation, by CPU: what the BLAS kernels sum in which order)
    wide = wide and query.dtype in (torch.float32, torch.float64) and query.device.type == "cpu"
    work = torch.float64 if wide else torch.float32
    q = query.reshape(b, kvh, g * ql, d).to(work)  # [B, kv_heads, G*q_len, D] (head h uses kv head h // G)
    scores = torch.matmul(q, keys.to(work).transpose(-1, -2)) * scaling  # [B, kv_heads, G*q_len, n]
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=work, device=mask.device)
        bias.masked_fill_(~mask, torch.finfo(work).min)  # [B, 1, q_len, n]
        scores = (scores.view(b, kvh, g, ql, -1) + bias.unsqueeze(2)).view(b, kvh, g * ql, -1)
    return torch.softmax(scores, dim=-1)
