"""CPU fast path for the block scoring of ``KVStore.select``: one small C routine, compiled once per machine.

On the CPU the scoring is a handful of tiny torch ops per layer and decode step (bmm of
``[kv_heads, G*q_len, hd] x [kv_heads, hd, m]``, softmax, amax; a bf16 -> float32 copy of the
digest range first), each paying torch's per-op dispatch: ~25 us at SmolLM2's shape (3 kv heads,
3 query heads per kv head, m = 250 candidate blocks), the largest single cost of a sparse decode
step's store calls. This routine computes the same scores in one pass straight from the digest
table (float32, bf16, or int8 codes with a float32 scale per row, read in place: no conversion
copy, no extra memory) in a few us.

Math (the specification is the torch code in ``Selector.scores``, select.py, which stays the
fallback and the CUDA path; tests/store/test_score_cpu.py compares the two):
  centroid  s[h, r, j] = scale * q[h, r] . mean[h, j];  score[j] = max_{h, r} softmax_j(s[h, r])[j]
  quest     s[h, r, j] = sum_d max(q_d, 0) * max[h, j, d] + min(q_d, 0) * min[h, j, d]
            score[j] = sum_h max_r s[h, r, j]
  int8      mean[h, j] (max | min) = codes[h, j] * rscale[h, j]: the dot runs on the codes and
            its result is multiplied by the row's scale
  int4      (centroid) mean[h, j, d] = codes[h, j, d] * s[h, b, d] + z[h, b, d] over the rows j of
            block b: q . mean = (q * s[h, b]) . codes + q . z[h, b], the query scaled once a block
  per head  score[h, j] is head h's term before the fold over h (max, or sum for quest); the
            top k go round-robin over the heads (``select.round_robin``)
Scores agree with torch to float32 rounding (summation order differs), so the top-k ranking is
the same except between blocks whose scores tie to within rounding.

The same file computes H2O's attention mass per key for a sparse step (:func:`key_mass`), the
other small per-layer pass over a step's query that torch ran as several ops, and the estimated
attention over the blocks a step did not select (:func:`rest_attend`), from the same digest.

Build: ``kvtier/csrc/score.c``, as :mod:`kvtier.compress.cpu` (system C compiler,
``$KVTIER_CACHE_DIR``, a name hashing the source, flags and CPU; loaded with ctypes). Without a compiler :func:`available` is False and
the store keeps the torch path.
"""
from __future__ import annotations

import ctypes

import torch

from kvtier._clib import CLibrary

from .table import INT4

_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-std=gnu11"]


def _declare(lib: ctypes.CDLL) -> None:
    i64, c_int, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.kvt_block_scores.argtypes = [vp, i64, i64, i64, vp, i64, i64, c_int, vp, i64, i64, ctypes.c_bool,
                                     ctypes.c_float, vp]
    lib.kvt_block_scores.restype = c_int
    lib.kvt_block_top.argtypes = lib.kvt_block_scores.argtypes[:-1] + [i64, i64, ctypes.c_bool, vp, i64,
                                                                       ctypes.c_float, vp, vp, c_int, i64, vp,
                                                                       i64, i64, ctypes.c_float, vp, vp]
    lib.kvt_block_top.restype = c_int
    lib.kvt_key_mass.argtypes = [vp, i64, i64, i64, vp, i64, c_int, i64, ctypes.c_float, vp]
    lib.kvt_key_mass.restype = c_int
    lib.kvt_rest_attend.argtypes = [vp, i64, i64, i64, c_int, vp, i64, vp, i64, vp, c_int, i64, vp, i64, i64, i64,
                                    i64, vp, ctypes.c_float, ctypes.c_float, vp, vp]
    lib.kvt_rest_attend.restype = i64
    lib.kvt_merge_rest.argtypes = [vp, i64, i64, i64, vp, i64, c_int, i64, ctypes.c_float, vp, vp, vp, c_int]
    lib.kvt_merge_rest.restype = c_int
    lib.kvt_merge_lse.argtypes = [vp, i64, i64, vp, vp, vp, c_int]
    lib.kvt_merge_lse.restype = None
    lib.kvt_decode_attend.argtypes = [vp, i64, i64, i64, vp, i64, vp, i64, c_int, i64, ctypes.c_float, vp, c_int,
                                      vp, vp, vp, vp]
    lib.kvt_decode_attend.restype = c_int


_LIB = CLibrary("score", _FLAGS, _declare, "select() uses torch ops")
_load = _LIB.load


def available() -> bool:
    """True when the compiled routine could be built and loaded on this machine."""
    return _load() is not None


#: digest dtypes the routine reads in place (int8 with its per-row float32 scales; packed int4
#: with its float16 scale | zero per channel and block, table.quantize_channels)
DTYPES = (torch.float32, torch.bfloat16, torch.int8, INT4)
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, INT4: 3}


def _digest_args(digest: torch.Tensor, digest_scale: torch.Tensor | None, lo: int, parts: int) -> tuple:
    """(kind, address of row lo, address of its first scale, scales per head, a table row's
    width in the C routines' elements: codes for int4) for the C routines."""
    kind = _KIND.get(digest.dtype)
    assert kind is not None, f"digest dtype must be one of {DTYPES}; got {digest.dtype}"
    kvh, cap, width = digest.shape
    base = digest.data_ptr() + lo * width * digest.element_size()
    if kind == 3:
        hd = 2 * width // parts
        assert (digest_scale is not None and digest_scale.dtype == torch.float16 and digest_scale.is_contiguous()
                and tuple(digest_scale.shape) == (kvh, cap, 2 * hd)), \
            f"int4 digest {tuple(digest.shape)} needs float16 scale | zero [{kvh}, {cap}, {2 * hd}]; got " \
            f"{None if digest_scale is None else (digest_scale.dtype, tuple(digest_scale.shape))}"
        return kind, base, digest_scale.data_ptr() + lo * 2 * hd * 2, cap * 2 * hd, 2 * width
    if kind != 2:
        assert digest_scale is None, "only an int8 or int4 digest has scales"
        return kind, base, None, 0, width
    assert (digest_scale is not None and digest_scale.dtype == torch.float32 and digest_scale.is_contiguous()
            and tuple(digest_scale.shape) == (kvh, cap, parts)), \
        f"int8 digest {tuple(digest.shape)} needs float32 scales [{kvh}, {cap}, {parts}]; got " \
        f"{None if digest_scale is None else (digest_scale.dtype, tuple(digest_scale.shape))}"
    return kind, base, digest_scale.data_ptr() + lo * parts * 4, cap * parts, width


def block_scores(q: torch.Tensor, digest: torch.Tensor, lo: int, hi: int, quest: bool, scale: float,
                 digest_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Scores of digest rows [lo, hi) (see the module docstring for the math).

    On the decode hot path (once per layer and step): the caller checked the query's shape
    already (``Selector.query_f32``); only what would make the C code read out of bounds is
    asserted here.

    Args:
        q: [q_heads, q_len, head_dim] float32 contiguous CPU, q_heads a multiple of kv_heads
            (query heads of one kv head adjacent, as transformers' ``repeat_kv``); a
            ``[kv_heads, R, head_dim]`` tensor of query rows per kv head is one such.
        digest: [kv_heads, cap, width] contiguous CPU table, float32, bfloat16 or int8; width =
            head_dim (centroid) or 2 * head_dim (quest: max | min).
        scale: centroid logit scale (ignored by quest).
        digest_scale: int8 digests only: float32 [kv_heads, cap, 1], row j stands for
            ``digest[:, j] * digest_scale[:, j]`` (``table.quantize_rows``).
    Returns:
        [hi - lo] float32 (owned).
    """
    fn = _load().kvt_block_scores  # AttributeError on None: callers check available() first
    qh, ql, hd = q.shape
    kvh, cap, width = digest.shape
    r = qh // kvh * ql  # GQA: the rows of kv head h are q[h*G:(h+1)*G] (contiguous), G*q_len of them
    assert (q.dtype == torch.float32 and q.is_contiguous() and digest.is_contiguous()
            and qh % kvh == 0 and width == (hd << quest) and 0 <= lo < hi <= cap), \
        f"q {q.dtype} {tuple(q.shape)}, digest {tuple(digest.shape)} rows [{lo}, {hi}), quest={quest}"
    m = hi - lo
    out = torch.empty(m, dtype=torch.float32)
    assert digest.dtype != INT4, "int4 digests hold several rows a block: use top_blocks"
    kind, base, sbase, sstride, _ = _digest_args(digest, digest_scale, lo, 1)
    if fn(q.data_ptr(), kvh, r, hd, base, cap * width, width, kind, sbase, sstride, m, quest, scale, out.data_ptr()):
        raise MemoryError("kvt_block_scores: out of memory")
    return out


def top_blocks(q: torch.Tensor, digest: torch.Tensor, lo: int, hi: int, quest: bool, scale: float,
               k: int, parts: int = 1, digest_scale: torch.Tensor | None = None,
               per_head: bool = False, favor=None, gain: float = 0.0, values: tuple | None = None):
    """The ``k`` best-scoring digest rows of [lo, hi), ascending, as offsets from ``lo``.

    The same scores as :func:`block_scores`; the selection is done in C too (no score tensor, no
    topk, no sort: fewer calls on the decode path). Ties at the k-th score go to the lower index.
    Arguments as :func:`block_scores`; 1 <= k <= hi - lo. ``parts`` > 1 (centroid only): each
    row holds that many sub-block centroids side by side (``width = parts * head_dim``), scored
    as ``Selector.scores`` does: one softmax over every sub-block, a block's score its best part.
    int8 ``digest_scale`` is then [kv_heads, cap, parts]: one scale per sub-block centroid.
    ``per_head``: each kv head ranks the rows on its own scores (before they are folded over
    heads) and the k slots go to the heads in turn, each taking its next best row not yet taken
    (``select_heads="per_head"``; ``select.round_robin`` is the specification).
    ``favor``: offsets from ``lo`` (an int64 numpy array; others out of range are ignored) whose
    block scores rise by ``gain`` times their magnitude before the ranking (``select.lift``).
    ``values`` (centroid only): ``(vdigest, vdigest_scale, value_parts, logn)`` as
    :func:`rest_attend` takes them; then the attention over the rows of [lo, hi) not taken is
    estimated from the same logits (``scale`` must be the attention's) and the call returns
    ``(top, (out, lse))`` (lse -inf where every row was taken), as :func:`rest_attend` would.
    """
    fn = _load().kvt_block_top
    qh, ql, hd = q.shape
    kvh, cap, width = digest.shape
    r = qh // kvh * ql  # GQA: the rows of kv head h are q[h*G:(h+1)*G] (contiguous), G*q_len of them
    kind, base, sbase, sstride, width = _digest_args(digest, digest_scale, lo, parts)
    assert (q.dtype == torch.float32 and q.is_contiguous() and digest.is_contiguous()
            and qh % kvh == 0 and parts >= 1 and (parts == 1 or not quest) and not (quest and kind == 3)
            and width == (hd << quest) * parts and 0 <= lo < hi <= cap and 1 <= k <= hi - lo), \
        f"q {q.dtype} {tuple(q.shape)}, digest {tuple(digest.shape)} rows [{lo}, {hi}), quest={quest}, k={k}, parts={parts}"
    out = (ctypes.c_int64 * k)()
    sub = width // parts  # one sub-block row: the rows of a block are consecutive
    est = vargs = None
    if values is not None:
        vdigest, vscale, vparts, logn = values
        assert (not quest and vdigest.dtype in _KIND and vdigest.dtype != INT4 and vdigest.is_contiguous()
                and tuple(vdigest.shape) == (kvh, cap, vparts * hd) and parts % vparts == 0), \
            f"vdigest {vdigest.dtype} {tuple(vdigest.shape)} for digest {tuple(digest.shape)}, {vparts} value parts"
        vkind, vbase, vsbase, vsstride, _ = _digest_args(vdigest, vscale, lo, vparts)
        est = (torch.empty(kvh, r, hd, dtype=torch.float32), torch.empty(kvh, r, dtype=torch.float32))
        vargs = (vbase, vkind, cap * vparts * hd, vsbase, vsstride, vparts, logn, est[0].data_ptr(),
                 est[1].data_ptr())
    if fn(q.data_ptr(), kvh, r, hd, base, cap * width, sub, kind, sbase, sstride, hi - lo, quest, scale, parts,
          k, per_head, None if favor is None else favor.ctypes.data, 0 if favor is None else len(favor),
          gain, out, *(vargs or (None, 0, 0, None, 0, 0, 0.0, None, None))):
        raise MemoryError("kvt_block_top: out of memory")
    return out[:] if est is None else (out[:], est)


def key_mass(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor | None:
    """The attention mass of each key, summed over query heads and rows: what H2O accumulates
    per block, ``attention_probs(query, keys, None, scale, wide=False).sum(dim=(1, 2))[0]``
    (kvtier/hf/sparse.py) computed in one compiled pass (the torch ops cost ~100 us a layer at
    a 1k-token budget, most of it a skinny matmul over strided keys). Same float32 math, another
    summation order.

    Args:
        query: [1, q_heads, q_len, head_dim] (q_heads a multiple of kv_heads, a kv head's query
            heads adjacent); keys: [1, kv_heads, n, head_dim] float32 or bfloat16 on the CPU,
            rows contiguous within a head (an L1 run view is).
    Returns:
        [n] float32, or None when these inputs are not the routine's (the caller takes torch).
    """
    lib = _load()
    b, qh, ql, hd = query.shape
    if (lib is None or b != 1 or keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[-1] != hd
            or keys.dtype not in (torch.float32, torch.bfloat16) or keys.device.type != "cpu"
            or query.device.type != "cpu" or keys.stride(-1) != 1 or keys.stride(-2) != hd
            or qh % keys.shape[1]):
        return None
    kvh, n = keys.shape[1], keys.shape[2]
    q = query.reshape(kvh, qh // kvh * ql, hd).to(torch.float32).contiguous()  # [kv_heads, G*q_len, D]
    out = torch.empty(n, dtype=torch.float32)
    if lib.kvt_key_mass(q.data_ptr(), kvh, q.shape[1], hd, keys.data_ptr(), keys.stride(1), _KIND[keys.dtype], n,
                        scale, out.data_ptr()):
        raise MemoryError("kvt_key_mass: out of memory")
    return out


def decode_attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mass: bool,
                  rest: tuple[torch.Tensor, torch.Tensor] | None = None, mass_len: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """One decode step's attention over gathered keys and values, its log-sum-exp and, with
    ``mass``, each key's attention mass (:func:`key_mass`), in one compiled pass: what CPU flash
    attention and :func:`key_mass` give in two (float32 math; another summation order, so equal
    to rounding). ``rest``: the estimate of the blocks not gathered, (out [q_heads, head_dim],
    lse [q_heads]) float32, merged into the output as :func:`merge_lse` merges it.
    ``mass_len``: the mass tensor's length when longer than n (zeros past n: whole blocks).

    Args:
        query: [1, q_heads, 1, head_dim]; keys, values: [1, kv_heads, n, head_dim] of the query's
            dtype (float32 or bfloat16) on the CPU, rows contiguous within a head (an L1 run
            view is), n >= 1.
    Returns:
        (out [1, 1, q_heads, head_dim] in the query's dtype, lse float32 [q_heads] of the exact
        part, mass float32 [max(n, mass_len)] or None), or None when these inputs are not the
        routine's.
    """
    lib = _load()
    b, qh, ql, hd = query.shape
    if (lib is None or b != 1 or ql != 1 or query.device.type != "cpu" or query.dtype not in (torch.float32, torch.bfloat16)
            or keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[-1] != hd or values.shape != keys.shape
            or keys.dtype != query.dtype or values.dtype != query.dtype or keys.device.type != "cpu"
            or values.device.type != "cpu" or keys.stride(-1) != 1 or keys.stride(-2) != hd
            or values.stride(-1) != 1 or values.stride(-2) != hd or qh % keys.shape[1] or keys.shape[2] == 0):
        return None
    kvh, n = keys.shape[1], keys.shape[2]
    q = query.reshape(kvh, qh // kvh, hd).to(torch.float32).contiguous()  # [kv_heads, G, D]
    out = torch.empty((1, 1, qh, hd), dtype=query.dtype)
    lse = torch.empty(qh, dtype=torch.float32)
    m = (torch.zeros(mass_len, dtype=torch.float32) if mass_len > n else torch.empty(n, dtype=torch.float32)) \
        if mass else None
    ro = rl = None
    if rest is not None:
        ro, rl = (t.float().contiguous() for t in rest)
        assert ro.numel() == qh * hd and rl.numel() == qh, f"rest {tuple(ro.shape)}, {tuple(rl.shape)} for {qh} heads"
    if lib.kvt_decode_attend(q.data_ptr(), kvh, qh // kvh, hd, keys.data_ptr(), keys.stride(1), values.data_ptr(),
                             values.stride(1), _KIND[keys.dtype], n, scale, out.data_ptr(), _KIND[out.dtype],
                             lse.data_ptr(), None if m is None else m.data_ptr(),
                             None if ro is None else ro.data_ptr(), None if rl is None else rl.data_ptr()):
        raise MemoryError("kvt_decode_attend: out of memory")
    return out, lse, m


def rest_attend(q: torch.Tensor, digest: torch.Tensor, digest_scale: torch.Tensor | None,
                vdigest: torch.Tensor, vdigest_scale: torch.Tensor | None, keep, value_parts: int,
                scale: float, logn: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``Selector.rest_estimate``'s attention over the key centroids of the blocks ``keep``
    marks (their values the means of ``vdigest``), read from the digest tables in place.

    Args:
        q: [kv_heads, R, head_dim] float32 contiguous CPU query rows (R = G*q_len per kv head).
        digest: [kv_heads, cap, parts * head_dim] centroid rows (float32, bfloat16 or int8, its
            scales ``digest_scale`` [kv_heads, cap, parts] float32), or packed int4
            [kv_heads, cap, parts * head_dim // 2] (``digest_scale`` float16 [kv_heads, cap,
            2 * head_dim]); vdigest: [kv_heads, cap, value_parts * head_dim], float32,
            bfloat16 or int8 (scales ``vdigest_scale`` [kv_heads, cap, value_parts] float32).
        keep: uint8 numpy array [m], m <= cap: nonzero for the blocks (from row 0) to estimate.
        scale: the logits' scale; logn: the log of the tokens a centroid stands for.
    Returns:
        ``(out [kv_heads, R, head_dim], lse [kv_heads, R])`` float32, or None when ``keep`` marks
        no block.
    """
    fn = _load().kvt_rest_attend
    kvh, r, hd = q.shape
    _, cap, width = digest.shape
    parts = width * (2 if digest.dtype == INT4 else 1) // hd
    m = len(keep)
    kind, kbase, ksbase, ksstride, width = _digest_args(digest, digest_scale, 0, parts)
    assert (q.dtype == torch.float32 and q.is_contiguous() and digest.is_contiguous() and vdigest.is_contiguous()
            and vdigest.dtype in _KIND and vdigest.dtype != INT4 and tuple(vdigest.shape) == (kvh, cap, value_parts * hd)
            and width == parts * hd and value_parts >= 1 and parts % value_parts == 0 and m <= cap
            and keep.dtype.itemsize == 1 and keep.flags.c_contiguous), \
        f"q {tuple(q.shape)}, digest {tuple(digest.shape)}, vdigest {tuple(vdigest.shape)}, {m} blocks"
    vkind, vbase, vsbase, vsstride, _ = _digest_args(vdigest, vdigest_scale, 0, value_parts)
    out = torch.empty(kvh, r, hd, dtype=torch.float32)
    lse = torch.empty(kvh, r, dtype=torch.float32)
    n = fn(q.data_ptr(), kvh, r, hd, kind, kbase, cap * width, ksbase, ksstride, vbase, vkind,
           cap * value_parts * hd, vsbase, vsstride, m, parts, value_parts, keep.ctypes.data, scale, logn,
           out.data_ptr(), lse.data_ptr())
    if n < 0:
        raise MemoryError("kvt_rest_attend: out of memory")
    return (out, lse) if n else None


def merge_rest(query: torch.Tensor, keys: torch.Tensor, scale: float, rest_out: torch.Tensor,
               rest_lse: torch.Tensor, out: torch.Tensor) -> bool:
    """``out`` (the exact attention over ``keys``) merged in place with the estimate of the rest,
    as ``kvtier.hf.sparse.with_rest`` computes it, in one compiled pass: the exact part's
    log-sum-exp from ``query`` and ``keys``, then ``lerp(rest_out, out, sigmoid(lse - rest_lse))``.

    Args:
        query: [1, q_heads, 1, head_dim]; keys: [1, kv_heads, n, head_dim] float32 or bfloat16,
            rows contiguous within a head (as :func:`key_mass`); rest_out: float32
            [q_heads, 1, head_dim], rest_lse: float32 [q_heads, 1] (contiguous);
            out: [1, 1, q_heads, head_dim] float32 or bfloat16, contiguous.
    Returns:
        False (nothing done) when these inputs are not the routine's: the caller takes torch.
    """
    lib = _load()
    b, qh, ql, hd = query.shape
    if (lib is None or b != 1 or ql != 1 or keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[-1] != hd
            or keys.dtype not in (torch.float32, torch.bfloat16) or keys.device.type != "cpu"
            or query.device.type != "cpu" or keys.stride(-1) != 1 or keys.stride(-2) != hd
            or qh % keys.shape[1] or out.dtype not in (torch.float32, torch.bfloat16) or not out.is_contiguous()
            or out.numel() != qh * hd or rest_out.dtype != torch.float32 or not rest_out.is_contiguous()
            or rest_lse.dtype != torch.float32 or not rest_lse.is_contiguous()):
        return False
    kvh, n = keys.shape[1], keys.shape[2]
    q = query.reshape(kvh, qh // kvh, hd).to(torch.float32).contiguous()  # [kv_heads, G, D]
    if lib.kvt_merge_rest(q.data_ptr(), kvh, q.shape[1], hd, keys.data_ptr(), keys.stride(1), _KIND[keys.dtype], n,
                          scale, rest_out.data_ptr(), rest_lse.data_ptr(), out.data_ptr(), _KIND[out.dtype]):
        raise MemoryError("kvt_merge_rest: out of memory")
    return True


def merge_lse(lse: torch.Tensor, rest_out: torch.Tensor, rest_lse: torch.Tensor, out: torch.Tensor) -> bool:
    """:func:`merge_rest` with the exact part's log-sum-exp already known (the kernel that
    attended the gathered blocks returned it): ``out`` merged in place, one pass.

    Args:
        lse: float32 [q_heads] (any shape of that many, contiguous); rest_out: float32
            [q_heads, 1, head_dim], rest_lse: float32 [q_heads, 1]; out: [1, 1, q_heads, head_dim]
            float32 or bfloat16; all contiguous, on the CPU.
    Returns:
        False (nothing done) when these inputs are not the routine's: the caller takes torch.
    """
    lib = _load()
    rows = lse.numel()
    if (lib is None or out.dtype not in (torch.float32, torch.bfloat16) or out.device.type != "cpu"
            or rows == 0 or out.numel() % rows or rest_out.numel() != out.numel() or rest_lse.numel() != rows
            or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (lse, rest_out, rest_lse))
            or not all(t.is_contiguous() for t in (lse, rest_out, rest_lse, out))):
        return False
    lib.kvt_merge_lse(lse.data_ptr(), rows, out.numel() // rows, rest_out.data_ptr(), rest_lse.data_ptr(),
                      out.data_ptr(), _KIND[out.dtype])
    return True
