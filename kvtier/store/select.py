"""Selection and attention feedback: which sealed blocks a sparse step attends (sinks, recent
window, top-k by key digest), and the attention mass observed per block (h2o, snapkv)."""
from __future__ import annotations

import math

import numpy as np
import torch

from . import score_cpu
from .layout import Layout
from .residency import Residency
from .table import BlockTable


class Selector:
    def __init__(self, layout: Layout, residency: Residency) -> None:
        self.layout = layout
        self.residency = residency
        # CPU: block scores in one compiled call, read from the digest table in place (score_cpu.py)
        self.compiled = (layout.digest_score is not None and layout.device.type == "cpu"
                         and layout.digest_dtype in score_cpu.DTYPES and score_cpu.available())
        # CUDA: the digest logits from one Triton kernel reading the table in place (score_triton.py)
        self.kernel = _triton_scorer() if layout.digest_score is not None and layout.device.type == "cuda" else None
        self._zeros = torch.zeros(1, 1, 1, device=layout.device)  # baddbmm's unread input (beta=0)

    def select(self, t: BlockTable, query: torch.Tensor, budget: int) -> list[int]:
        """Sorted sealed block indices to attend within ``budget`` tokens (open block included)."""
        return self._select(t, query, budget, None)[0]

    def select_with_rest(self, t: BlockTable, query: torch.Tensor, budget: int, scaling: float,
                         visible: torch.Tensor | None = None) -> tuple[list[int], tuple | None]:
        """:meth:`select`, and :meth:`rest_estimate` of the blocks it leaves out: ``(sel, (out,
        lse) or None)``. Where the attention's scale is the scorer's the digest is read once a
        step: on the CPU, where every token is visible, the estimate comes from the compiled
        scorer's own logits (one call); on CUDA and on the torch path (centroid digests) from the
        logits the selection computed, the blocks it left out taken from them."""
        lay = self.layout
        same_scale = math.isclose(scaling, lay.head_dim ** -0.5, rel_tol=1e-6)
        if self.compiled:
            reuse = visible is None and same_scale
        else:
            reuse = same_scale and lay.digest_score == "centroid"
        sel, est, span = self._select(t, query, budget, scaling if reuse else None)
        if est is None:
            return sel, self.rest_estimate(t, query, sel, scaling, visible, span)
        qh, ql, hd = query.shape
        return sel, (est[0].view(qh, ql, hd), est[1].view(qh, ql))

    def _select(self, t: BlockTable, query: torch.Tensor, budget: int, rest_scaling: float | None):
        """(:meth:`select`'s blocks, the compiled scorer's estimate of the candidates it did not
        take or None, ``(lo, logits)`` of the candidates or None). With ``rest_scaling`` (the
        scorer's scale) and candidates to score: the compiled path returns the estimate, the
        others their candidates' centroid logits (:meth:`_logits` of [lo, w_start)), for
        :meth:`rest_estimate` to reuse."""
        lay = self.layout
        ns = t.n_sealed
        nb = budget // lay.block_tokens - 1
        if ns <= nb:
            return list(range(ns)), None, None
        s_end = min(lay.sink_blocks, nb)
        w_start = max(s_end, ns - min(lay.window_blocks, nb - s_end))
        k = nb - s_end - (ns - w_start)
        sel = list(range(s_end))
        est = span = None
        if k > 0:
            gain = lay.stickiness
            favor = self.resident_offsets(t, s_end, w_start) if gain > 0 else None
            if self.compiled:
                # scores and selection in one compiled call, already ascending
                # an estimate only where candidates are left out (k < w_start - s_end); else the
                # caller's rest_estimate finds none
                values = None if rest_scaling is None or k >= w_start - s_end else (
                    t.vdigest, t.vdigest_scale, lay.value_parts, math.log(lay.block_tokens // lay.digest_parts))
                top = score_cpu.top_blocks(self.query_f32(query), t.digest, s_end, w_start,
                                        lay.digest_score == "quest", lay.head_dim ** -0.5, k,
                                        lay.digest_parts, t.digest_scale, lay.select_per_head, favor, gain,
                                        values)
                if values is not None:
                    top, est = top
                sel += [b + s_end for b in top]
            else:
                logits = self._logits(t, query, s_end, w_start)
                if rest_scaling is not None:
                    span = (s_end, logits)
                if lay.select_per_head:
                    scores = lift(self._fold(logits, True), favor, gain)
                    sel += [b + s_end for b in round_robin(scores, k)]
                else:
                    scores = lift(self._fold(logits, False), favor, gain)
                    top = torch.topk(scores, k, sorted=False).indices.tolist()
                    sel += sorted(b + s_end for b in top)
        sel += range(w_start, ns)
        return sel, est, span

    @staticmethod
    def resident_offsets(t: BlockTable, lo: int, hi: int) -> np.ndarray:
        """The blocks of ``t`` in [lo, hi) that hold an L1 slot, as int64 offsets from ``lo``."""
        res = np.fromiter(t.slotted, dtype=np.int64, count=len(t.slotted)) - lo
        return res[(res >= 0) & (res < hi - lo)]

    def query_f32(self, query: torch.Tensor) -> torch.Tensor:
        """Checked query [q_heads, q_len, head_dim] as contiguous float32 on the device."""
        lay = self.layout
        qh, ql, hd = query.shape
        if qh % lay.kv_heads or hd != lay.head_dim:
            raise ValueError(f"query must be [q_heads (multiple of {lay.kv_heads}), q_len, {lay.head_dim}]; "
                             f"got {tuple(query.shape)}")
        if query.dtype != torch.float32 or query.device != lay.device:
            query = query.to(lay.device, torch.float32)
        return query if query.is_contiguous() else query.contiguous()

    def query_rows(self, query: torch.Tensor) -> torch.Tensor:
        """Checked query -> float32 [kv_heads, G*q_len, head_dim]: GQA groups consecutive query
        heads per kv head, so the rows of one kv head are adjacent (a view, no copy)."""
        return self.query_f32(query).view(self.layout.kv_heads, -1, self.layout.head_dim)

    def scores(self, t: BlockTable, query: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Score of each sealed block in [lo, hi) against ``query`` (higher = attend); see
        ``KVTierConfig.select_score``. The torch math: the specification of score_cpu.py's CPU path."""
        return self._fold(self._logits(t, query, lo, hi), False)

    def head_scores(self, t: BlockTable, query: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Per kv head: [kv_heads, m] scores of the sealed blocks in [lo, hi), each head's before
        :meth:`scores` folds them (centroid: its best query row's softmax; quest: its bound)."""
        return self._fold(self._logits(t, query, lo, hi), True)

    def _fold(self, s: torch.Tensor, per_head: bool) -> torch.Tensor:
        """Block scores from :meth:`_logits`' ``s``: [kv_heads, m] per head, else [m] (centroid:
        the best query row's softmax of the best head; quest: the bounds summed over heads).
        ``s`` itself is left as it is (the estimate may reuse it)."""
        p = self.layout.digest_parts
        if self.layout.digest_score == "centroid":
            best = torch.softmax(s, dim=-1).amax(dim=1)  # [kv_heads, m*parts]: each head's best query
            if not per_head:
                best = best.amax(dim=0)  # [m*parts]: the best head's
            return best if p == 1 else best.view(*best.shape[:-1], -1, p).amax(dim=-1)  # the best sub-block
        best = s.amax(dim=1)  # [kv_heads, m]
        return best if per_head else best.sum(dim=0)

    def _logits(self, t: BlockTable, query: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """[kv_heads, G*q_len, m*parts] centroid logits (scaled), or [kv_heads, G*q_len, m] quest bounds."""
        q = self.query_rows(query)  # [kv_heads, G*q_len, hd]
        hd = self.layout.head_dim
        if self.kernel is not None:
            if self.layout.digest_score == "centroid":
                return self.kernel.digest_logits(q, t.digest, t.digest_scale, lo, hi, self.layout.digest_parts,
                                                 hd ** -0.5)
            qq = torch.cat((q.clamp(min=0), q.clamp(max=0)), dim=-1)  # Quest, as below
            return self.kernel.digest_logits(qq, t.digest, t.digest_scale, lo, hi, 1, 1.0)
        # [kv_heads, hd, m*parts] (mean) or [kv_heads, 2*hd, m] (max | min); int8: codes, and the
        # scales [kv_heads, 1, m*parts] their dot products are multiplied by (as score_cpu.py does;
        # measured faster on the CPU than scaling the codes before the bmm)
        dig_t, dig_scale = t.digest_t(lo, hi)
        if dig_t.dtype != torch.float32:
            dig_t = dig_t.float()  # this call's working copy of the range, freed when it returns
        if self.layout.digest_score == "centroid":
            # bmm and scale in one op (beta=0: the [1, 1, 1] zeros are never read)
            s = torch.baddbmm(self._zeros, q, dig_t, beta=0.0, alpha=hd ** -0.5)  # [kv_heads, G*q_len, m*parts]
            if dig_scale is not None:
                s.mul_(dig_scale)
            return s
        # Quest: q_d*max_d where q_d >= 0, q_d*min_d where q_d < 0: one bmm against [max | min]
        qq = torch.cat((q.clamp(min=0), q.clamp(max=0)), dim=-1)  # [kv_heads, G*q_len, 2*hd]
        s = torch.bmm(qq, dig_t)  # [kv_heads, G*q_len, m]
        if dig_scale is not None:
            s.mul_(dig_scale)
        return s

    def rest_estimate(self, t: BlockTable, query: torch.Tensor, chosen, scaling: float,
                      visible: torch.Tensor | None = None,
                      span: tuple[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Attention of ``query`` over the sealed blocks of ``t`` outside ``chosen``, estimated
        from the digest (``rest_attention="estimate"``): each key centroid is one key standing
        for the ``digest_tokens`` tokens it averages (``log(digest_tokens)`` added to its logit,
        so its weight is that of as many equal keys), whose value is the mean of the values of
        its ``value_digest_tokens`` sub-block.

        Args:
            query: [q_heads, q_len, head_dim]; chosen: the block indices attended exactly (any
                order; the open block may be among them); scaling: the logits' scale.
            visible: bool [>= n_sealed * block_tokens] (CPU) or None: the tokens the step's mask
                lets the query see; a block with a hidden token is left out.
            span: ``(lo, logits)``: :meth:`_logits` of blocks [lo, lo + m) at ``scaling`` (the
                selection's), reused instead of reading the digest again when every block to
                estimate lies in it (not on the compiled path).
        Returns:
            ``(out, lse)``, float32 ``[q_heads, q_len, head_dim]`` and ``[q_heads, q_len]``: the
            softmax-weighted values of the estimate and the natural log of its softmax
            denominator; None when no block is left to estimate.
        """
        lay = self.layout
        ns = t.n_sealed
        keep = np.ones(ns, dtype=np.bool_)
        keep[[b for b in chosen if b < ns]] = False
        if visible is not None:
            keep &= visible[: ns * lay.block_tokens].view(ns, lay.block_tokens).all(dim=1).numpy()
        qh, ql, hd = query.shape
        kvh = lay.kv_heads
        q = self.query_rows(query)  # [kv_heads, G*q_len, hd]
        logn = math.log(lay.block_tokens // lay.digest_parts)
        if self.compiled:
            r = score_cpu.rest_attend(q, t.digest, t.digest_scale, t.vdigest, t.vdigest_scale,
                                      keep.view(np.uint8), lay.value_parts, scaling, logn)
            return None if r is None else (r[0].view(qh, ql, hd), r[1].view(qh, ql))
        if not keep.any():
            return None
        p, vp = lay.digest_parts, lay.value_parts
        m = 0 if span is None else span[1].shape[-1] // p
        if m and not keep[: span[0]].any() and not keep[span[0] + m:].any():
            # the selection's logits: the columns of the blocks left out, their value means
            lo, lg = span
            rest = torch.from_numpy(np.flatnonzero(keep[lo: lo + m])).to(lay.device)
            logits = lg.reshape(kvh, lg.shape[1], m, p).index_select(2, rest).reshape(kvh, lg.shape[1], -1)
            values = t.value_means(rest + lo)  # [kv_heads, len(rest), value_parts, hd]
        elif self.kernel is not None:
            # every sealed block's logits from the table in place, the ones not estimated masked out:
            # no dequantized copy of the (mostly unselected) range
            logits = self.kernel.digest_logits(q, t.digest, t.digest_scale, 0, ns, p, scaling)
            cols = torch.from_numpy(keep).to(lay.device).repeat_interleave(p)  # [ns*parts]
            logits.masked_fill_(~cols, -math.inf)
            values = t.value_means(torch.arange(ns, device=lay.device))  # [kv_heads, ns, value_parts, hd]
        else:
            rest = torch.from_numpy(np.flatnonzero(keep)).to(lay.device)
            keys = t.key_centroids(rest).view(kvh, -1, hd)  # [kv_heads, m*parts, hd]
            values = t.value_means(rest)  # [kv_heads, m, value_parts, hd]
            logits = torch.bmm(q, keys.transpose(1, 2)).mul_(scaling)  # [kv_heads, G*q_len, m*parts]
        logits += logn
        lse = torch.logsumexp(logits, dim=-1)  # [kv_heads, G*q_len]
        # a value mean stands for parts / value_parts key rows: their weights summed, not the
        # values repeated per row
        rows = logits.shape[1]
        w = torch.softmax(logits, dim=-1).view(kvh, rows, -1, p // vp).sum(dim=-1)  # [kv_heads, G*q_len, m*value_parts]
        out = torch.bmm(w, values.view(kvh, -1, hd))  # [kv_heads, G*q_len, hd]
        return out.view(qh, ql, hd), lse.view(qh, ql)

    def observe(self, t: BlockTable, blocks, mass, snap_steps: int) -> None:
        """Accumulate ``mass`` per block of ``blocks`` (a trailing extra one: the open block)."""
        m = mass.tolist() if isinstance(mass, torch.Tensor) else list(mass)
        blocks = list(blocks)
        if len(m) not in (len(blocks), len(blocks) + 1):
            raise ValueError(f"mass must have len(blocks) or len(blocks)+1 entries; got {len(m)} for "
                             f"{len(blocks)} blocks")
        if len(m) == len(blocks) + 1:
            blocks.append(len(t.entries) - 1)
        self.residency.observe(t, blocks, m, snap_steps)

    def block_mass(self, t: BlockTable, k: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """SnapKV voting: attention of ``query`` [q_heads, w, head_dim] over every token of
        ``k`` [kv_heads, T, head_dim], pooled per block -> [blocks of t]."""
        lay = self.layout
        qh, w, hd = query.shape
        g = qh // lay.kv_heads
        q = query.to(k.device, torch.float32).reshape(lay.kv_heads, g * w, hd)
        att = torch.softmax(q @ k.float().transpose(1, 2) / math.sqrt(hd), dim=-1)  # [kv_heads, g*w, T]
        per_tok = att.sum(dim=(0, 1))  # [T]
        nb = len(t.entries)
        pad = nb * lay.block_tokens - per_tok.shape[0]
        return torch.nn.functional.pad(per_tok, (0, pad)).view(nb, lay.block_tokens).sum(1)


def _triton_scorer():
    """:mod:`score_triton` when triton imports (CUDA stores), else None (the torch math)."""
    try:
        from . import score_triton
    except ImportError:
        return None
    return score_triton


def lift(scores: torch.Tensor, favor: np.ndarray | None, gain: float) -> torch.Tensor:
    """``scores`` [..., m] with the candidates ``favor`` (offsets, or None) raised by ``gain``
    times their magnitude where finite (``select_stickiness``: ``s * (1 + gain)`` for the
    centroid's probabilities). The specification of the compiled path's ``lift`` (score.c)."""
    if favor is None or gain <= 0 or len(favor) == 0:
        return scores
    idx = torch.from_numpy(favor).to(scores.device)
    s = scores.index_select(-1, idx)
    scores = scores.clone()
    scores.index_copy_(-1, idx, torch.where(torch.isfinite(s), s + gain * s.abs(), s))
    return scores


def round_robin(head_scores: torch.Tensor, k: int) -> list[int]:
    """``k`` blocks, ascending, taken in turn from each kv head's ranking of ``head_scores``
    [kv_heads, m]: head 0's best, head 1's best, ..., then each head's next best not yet taken.
    A head's ranking: higher score first, ties to the lower index, NaN last. The specification of
    the compiled path's per-head selection (csrc/score.c ``kvt_block_top``)."""
    h, m = head_scores.shape
    if not 1 <= k <= m:
        raise ValueError(f"k must be in [1, {m}] (candidate blocks); got {k}")
    s = torch.nan_to_num(head_scores.float(), nan=-math.inf)
    # a head never looks past its k-th block: each block it passes over is one taken, by it or
    # another head, and at most k are taken
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k].tolist()
    taken: set[int] = set()
    nxt = [0] * h
    while len(taken) < k:
        for head in range(h):
            row = order[head]
            while nxt[head] < k and row[nxt[head]] in taken:
                nxt[head] += 1
            if nxt[head] < k:
                taken.add(row[nxt[head]])
                nxt[head] += 1
                if len(taken) == k:
                    break
    return sorted(taken)
