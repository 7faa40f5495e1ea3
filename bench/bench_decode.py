"""Decode speed and memory of kvtier against transformers' caches, on the real model.

Every configuration prefills the same context of real text, then decodes greedily; the decode
steps after a warm-up are timed (device synchronized). All caches run in one process, one after
the other, so the ratios compare like with like. The model is ``--model`` (``kvtier.models``'
names: smollm2-135m, the default, 8,192 positions; qwen2.5-coder-0.5b, 32,768 positions; or a
local transformers directory or .gguf file). The text is one contiguous run of pydoc topics from
token 1,000 (~113k tokens with SmolLM2's tokenizer, ~106k with Qwen's), never repeated: every
context up to both models' positions fits, and a longer one is refused. The prefill computes
only the last position's logits. The caches:

  dynamic         transformers DynamicCache (the reference: ratios are to it)
  quanto-int4     transformers QuantizedCache, optimum-quanto backend (KIVI-style, residual 128)
  hqq-int4        transformers QuantizedCache, HQQ backend
  kvtier-*        TieredCache, int8 / int4, dense / sparse, L1 = --l1-fraction of the context
                  (default 25%; sparse budget = L1), the rest in the L2 DRAM ring (L3 not used);
                  blocks of --block-tokens, by default KVTierConfig's for the attention mode
                  (16 tokens sparse, 64 dense: what a user who sets none gets);
                  kvtier-int4-sparse-d2 (only when named): the same with a key digest row per
                  pair of tokens (digest_tokens=2, their mean: half the digest bytes of the
                  default's row per token); kvtier-int4-sparse-d1 names the default's 1 explicitly;
                  kvtier-int4-sparse-k4 (only when named): key rows as 4-bit codes per channel
                  (digest_dtype="int4", 48 bytes a row and kv head at head_dim 64 against 68)

Reported per (context, config): decode tokens/s and its ratio to DynamicCache, peak memory
above the model (CUDA: max allocated; CPU: peak RSS sampled every 2 ms), and KV bytes per token
(all tiers; quantized parts, scales and residual windows included) as a ratio to DynamicCache.
Target: kvtier int4 sparse at 4k >= 1.0x DynamicCache speed and >= 1.3x quanto int4,
at fewer bytes per token than both.

    python bench/bench_decode.py                 # 1k and 4k context, 32 timed steps
    python bench/bench_decode.py --smoke         # seconds; run by `make bench-smoke`
    python bench/bench_decode.py --device cuda --dtype float16
    python bench/bench_decode.py --contexts 4096 --configs kvtier-int4-sparse kvtier-int4-sparse-d2 \
        --steps 48 --threads 1 --dtype float32 --repeat 5
    python bench/bench_decode.py --base a4e1479 --contexts 4096 --configs kvtier-int4-sparse --rounds 3
    python bench/bench_decode.py --model qwen2.5-coder-0.5b --base a4e1479 --contexts 32768 \
        --configs kvtier-int4-sparse --l1-fraction 0.03 --rounds 3 --steps 48 --threads 1 \
        --prefill-cache ~/.cache/kvtier/bench-prefill --fill-from-prefill

--repeat N: every configuration N times per context in this process, the order rotated each pass
(DynamicCache first in the first pass, whose tokens the others are fed); each pass's ratios are
taken within the pass, and the median and range of the N printed (the 4k target is judged on the
median). On a shared 2-core machine one pass's ratio of the same build moved between 0.93x and
1.07x; a difference of a few percent between two rows needs the median of several passes.

--base REV: this tree and the kvtier of git revision REV (exported with ``git archive``) run
alternately, each round one child process per tree (the order swapped every round), each
measuring DynamicCache and --configs in the same process with this script's workload; every
run's ratio to DynamicCache is printed, then the median and range per tree with the median
tok/s of kvtier and of DynamicCache (a ratio also moves with its denominator). A shared machine's
load moves both trees' runs alike, and each ratio is taken within one process. The parent
resolves --model with this tree's loader to its local transformers directory (a name is
converted once into the model cache) and passes the directory to both children: an older
tree's loader (a4e1479's ``kvtier.integrations.model``) knows no model names but loads any
such directory, so both trees run the same weights with their own loader and cache.

--prefill-cache DIR: DynamicCache's prefill of each context is kept in DIR by kvtier eval's
``kvtier.eval.caches.prefill`` (safetensors, keyed by the model's directory and dtype and the
token ids; this tree's module loaded by path, so an older tree's child uses it too) and read
back by later runs: every run after the first prefills once (kvtier's cache) instead of twice,
which at 32k is CPU-minutes a run. kvtier's caches prefill through the model (their prefill
builds the store) unless --fill-from-prefill is given: then they too are filled from the kept
prefill, a DynamicCache holding it taken over with ``TieredCache.wrap`` (how ``kvtier eval
--prefill-cache`` builds its rows), so a 32k run of several caches and both trees costs one
prefill in all. The timed decode steps are the same either way; a kept
row's ``prefill_s`` is then the time the reference's prefill took when computed, its peak memory
that of reading it back, and its row says ``prefill_kept``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

KVTIER_CONFIGS = {
    # name: (codec, attention, policy)
    "kvtier-int8-dense": ("int8", "dense", "lru"),
    "kvtier-int8-sparse": ("int8", "sparse", "h2o"),
    "kvtier-int4-dense": ("int4", "dense", "lru"),
    "kvtier-int4-sparse": ("int4", "sparse", "h2o"),
    "kvtier-int4-sparse-d1": ("int4", "sparse", "h2o"),
    "kvtier-int4-sparse-d2": ("int4", "sparse", "h2o"),
    "kvtier-int4-sparse-k4": ("int4", "sparse", "h2o"),
    "kvtier-int4-sparse-k8": ("int4", "sparse", "h2o"),
}
# rows that differ from another in config fields beyond the three above; asked for by name, not
# run by default
KVTIER_FIELDS = {"kvtier-int4-sparse-d1": {"digest_tokens": 1},  # a key digest row per token
                 "kvtier-int4-sparse-d2": {"digest_tokens": 2},  # one per pair of tokens
                 "kvtier-int4-sparse-k4": {"digest_dtype": "int4"},  # a 4-bit key row per token
                 "kvtier-int4-sparse-k8": {"digest_dtype": "int8"}}  # an int8 one (the default before)
BASELINE_CONFIGS = ("dynamic", "quanto-int4", "hqq-int4")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak memory above the level at entry: CUDA allocator peak, or sampled process RSS."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.base = _rss()
            self._stop = threading.Event()
            self._max = self.base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._max = max(self._max, _rss())

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._max, _rss()) - self.base


def _by_path(relpath: str):
    """A module of this tree loaded by its file path, so a child running an older tree's kvtier
    (--base) does not put this tree's package on sys.path. Only modules whose top-level imports
    are outside kvtier qualify."""
    import importlib.util

    name = "kvtier_bench_" + relpath.replace("/", "_").removesuffix(".py")
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), relpath)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _baselines():
    """tests/baselines.py: transformers' caches, no kvtier import."""
    return _by_path("tests/baselines.py")


def _reference_prefill(model, ids: torch.Tensor, prefill_dir: str):
    """DynamicCache's prefill of ``ids`` through ``kvtier.eval.caches.prefill``: kept in
    ``prefill_dir`` as safetensors (keyed by the model's directory and dtype and the token ids)
    and read back by later runs, the other tree's child included."""
    from pathlib import Path

    return _by_path("kvtier/eval/caches.py").prefill(model, ids, cache_dir=Path(prefill_dir))


def _kvtier_cache():
    """This tree's transformers adapter module, or an older tree's (--base) from before it moved."""
    try:
        from kvtier.hf import cache
    except ImportError:
        from kvtier.integrations import cache
    return cache


def _kvtier_models():
    """This tree's model loader, or an older tree's (--base) from before it moved."""
    try:
        from kvtier import models
    except ImportError:
        from kvtier.integrations import model as models
    return models


def resolve_model(model: str | None, contexts: list[int]) -> str | None:
    """``--model`` as a local transformers directory, with the running tree's loader: a name
    (this tree's ``kvtier.models.MODELS``) is converted once into the model cache and named by
    its directory, which every tree's ``load_model`` takes. An older tree's loader (a --base
    child) knows no names; its parent always passes it a directory (None: that tree's default).

    Raises ValueError when ``model`` is neither a name nor a path, or a context exceeds its
    positions (checked before an embedded model is converted).
    """
    models = _kvtier_models()
    positions = None
    if hasattr(models, "model_dir"):
        path, embedded = models.resolve_model(model)
        if path is not None and not os.path.exists(os.path.expanduser(path)):
            raise ValueError(f"--model {path!r} is neither an embedded model ({', '.join(models.MODELS)}) "
                             "nor an existing path")
        positions = embedded.max_positions if embedded is not None else None
        _check_positions(contexts, positions, model)
        directory = str(models.model_dir(model))
    elif model is None or os.path.isdir(model):
        directory = model
    else:
        raise ValueError(f"--model {model!r}: this tree's loader takes only a transformers directory")
    if directory is not None and positions is None:
        with open(os.path.join(directory, "config.json")) as f:
            _check_positions(contexts, json.load(f).get("max_position_embeddings"), model)
    return directory


def _check_positions(contexts: list[int], positions: int | None, model: str | None) -> None:
    too_long = [c for c in contexts if positions is not None and c > positions]
    if too_long:
        raise ValueError(f"--contexts {too_long} exceed the model's {positions:,} positions "
                         f"(--model {model or 'smollm2-135m'})")


def child_argv(args, context: int, out: str, model_dir: str | None) -> list[str]:
    """The command line of one --base child: this script, one context, the parent's settings,
    the model as the directory :func:`resolve_model` found (so an older tree loads the same
    weights), its rows written to ``out``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--contexts", str(context), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--block-tokens-dense", str(args.block_tokens_dense),
           "--block-tokens-sparse", str(args.block_tokens_sparse),
           "--l1-fraction", str(args.l1_fraction), "--device", args.device, "--dtype", args.dtype,
           "--configs", *args.configs, "--json", out]
    if model_dir is not None:
        cmd += ["--model", model_dir]
    if args.prefill_cache is not None:
        cmd += ["--prefill-cache", args.prefill_cache]
    if args.fill_from_prefill:
        cmd += ["--fill-from-prefill"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd


def resolve_block_tokens(args) -> None:
    """Fill ``args.block_tokens_dense``/``_sparse``: ``--block-tokens`` for both, else this tree's
    ``kvtier.config.default_block_tokens`` per attention mode. Called by :func:`parse_args`; a --base
    child is given both values by its parent (this tree), so it never imports an older tree's defaults."""
    for mode in ("dense", "sparse"):
        field = f"block_tokens_{mode}"
        if getattr(args, field) is None:
            if args.block_tokens is not None:
                setattr(args, field, args.block_tokens)
            else:
                from kvtier.config import default_block_tokens

                setattr(args, field, default_block_tokens(mode))


def row_block_tokens(args, name: str) -> int:
    """The block size of kvtier row ``name`` (the dense or sparse value :func:`resolve_block_tokens` set)."""
    return args.block_tokens_sparse if KVTIER_CONFIGS[name][1] == "sparse" else args.block_tokens_dense


def make_cache(name: str, model, context: int, block_tokens: int, l1_fraction: float, fill=None):
    """Row ``name``'s cache, empty, or holding the prefill in ``fill`` (a filled DynamicCache): a
    kvtier cache takes it over with ``TieredCache.wrap`` (how ``kvtier eval`` builds its rows from
    a shared prefill; a sparse cache filled by bare ``update()`` calls outside a forward would see
    no step of its attention), a baseline gets each layer through ``update()`` as its prefill
    would."""
    from kvtier.config import KVTierConfig

    make_baseline = _baselines().make_baseline
    TieredCache = _kvtier_cache().TieredCache

    if name in BASELINE_CONFIGS:
        cache = make_baseline(name, model)
        if fill is not None:
            for layer, ly in enumerate(fill.layers):
                cache.update(ly.keys, ly.values, layer)
        return cache
    codec, attention, policy = KVTIER_CONFIGS[name]
    hot = max(4 * block_tokens, int(context * l1_fraction) // block_tokens * block_tokens)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # Qwen2's config has none
    kv_bytes_fp16 = 2 * cfg.num_key_value_heads * head_dim * 2 * cfg.num_hidden_layers
    # L1's field is device_tokens; an older tree run with --base knows it as hot_tokens
    l1_field = "device_tokens" if "device_tokens" in KVTierConfig.__dataclass_fields__ else "hot_tokens"
    cfg = KVTierConfig(block_tokens=block_tokens, **{l1_field: hot}, max_sequences=1,
                       host_bytes=max(1 << 20, int(1.25 * (context + 256) * kv_bytes_fp16)),
                       disk_path=None, codec=codec, group_size=32, policy=policy, attention=attention,
                       budget_tokens=hot if attention == "sparse" else None, **KVTIER_FIELDS.get(name, {}))
    return TieredCache(cfg, model) if fill is None else TieredCache.wrap(fill, cfg, model)


def kv_bytes(cache) -> int:
    TieredCache = _kvtier_cache().TieredCache

    if isinstance(cache, TieredCache):
        return sum(cache.stats()["bytes"].values())
    return _baselines().cache_bytes(cache)


@torch.inference_mode()
def run_one(name: str, model, ids: torch.Tensor, steps: int, warmup: int, block_tokens: int,
            l1_fraction: float, forced: list[int] | None = None, prefill_dir: str | None = None,
            fill_all: bool = False) -> dict:
    """Prefill ``ids``, decode ``warmup`` + ``steps`` tokens greedily, time the last ``steps``.

    ``prefill_dir``: DynamicCache's prefill is kept there and reused (:func:`_reference_prefill`),
    by the reference only, or with ``fill_all`` by every cache (:func:`make_cache`'s ``fill``); ``prefill_s`` is then the time it took when computed, and the
    peak memory that of reading it. The timed decode steps are the same either way.

    ``forced``: the reference's tokens (its ``"tokens"``); each step then takes the reference's
    token as input instead of its own, so every cache predicts from the same text and
    ``"tokens"`` holds its own greedy choice at each position (the prefill's first): comparing
    free-running outputs would count every token after the first difference as a miss.
    """
    adapter = _kvtier_cache()
    TieredCache, detach = adapter.TieredCache, adapter.detach

    device = ids.device
    gc.collect()
    with PeakMemory(device) as mem:
        cache = None
        try:
            kept = prefill_dir is not None and (name == "dynamic" or fill_all)
            t0 = time.perf_counter()
            if kept:
                pre = _reference_prefill(model, ids, prefill_dir)
                filled = _baselines().make_baseline("dynamic", model)
                for layer, (k, v) in enumerate(pre.kv):
                    filled.update(k.to(device), v.to(device), layer)  # copies: the kept tensors go
                nxt = pre.logits.argmax().view(1, 1).to(device)
                prefill_s = pre.seconds
                del pre
                cache = filled if name == "dynamic" else make_cache(name, model, ids.shape[1], block_tokens,
                                                                    l1_fraction, fill=filled)
                del filled
            else:
                cache = make_cache(name, model, ids.shape[1], block_tokens, l1_fraction)
                # only the last position's logits: all of them would be GBs at 32k (Qwen's vocabulary is 152k)
                out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
                nxt = out.logits[:, -1:].argmax(-1)
                del out
            _sync(device)
            if not kept:
                prefill_s = time.perf_counter() - t0
            tokens = [int(nxt[0, 0])]

            def step(i: int) -> torch.Tensor:
                inp = nxt if forced is None else torch.tensor([[forced[i]]], device=device)
                return model(input_ids=inp, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)

            for i in range(warmup):
                nxt = step(i)
                tokens.append(int(nxt[0, 0]))
            _sync(device)
            before = cache.stats() if isinstance(cache, TieredCache) else None
            times = []
            for i in range(warmup, warmup + steps):
                t = time.perf_counter()
                nxt = step(i)
                _sync(device)
                times.append(time.perf_counter() - t)
                tokens.append(int(nxt[0, 0]))
            seq_len = cache.get_seq_length()
            nbytes = kv_bytes(cache)
            extra = {}
            if isinstance(cache, TieredCache):
                s = cache.stats()
                # per layer and timed step: blocks swapped into L1 (a read's misses) and reads
                # that found the region full and used a scratch slot
                per = steps * model.config.num_hidden_layers
                extra = {"attended_fraction": s["integration"]["attended_fraction"],
                         "bytes_by_tier": s["bytes"], "misses_l1": s["misses"]["l1"],
                         "swap_ins_per_layer_step": (s["misses"]["l1"] - before["misses"]["l1"]) / per,
                         "scratch_per_layer_step": (s["scratch_uses"] - before["scratch_uses"]) / per}
        finally:
            if isinstance(cache, TieredCache):
                cache.close()
                detach(model)
    times.sort()
    total = sum(times)
    return {
        "config": name, "context": ids.shape[1], "steps": steps, "block_tokens": block_tokens,
        "tokens_per_s": steps / total, "p50_ms": 1e3 * times[len(times) // 2], "p99_ms": 1e3 * times[-1] if len(times) < 100 else 1e3 * times[int(0.99 * len(times))],
        "prefill_s": prefill_s, "prefill_kept": kept, "peak_mem_bytes": mem.peak, "kv_bytes": nbytes,
        "bytes_per_token": nbytes / seq_len, "tokens": tokens, **extra,
    }


def run_alternating(args, model_dir: str | None) -> int:
    """--base: this tree and revision ``args.base`` alternated in child processes (module doc)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", args.base], capture_output=True,
                            text=True, check=True).stdout.strip()
    here = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "kvtier"], capture_output=True,
                           text=True, check=True).stdout.strip()
    name_here = here + ("+" if dirty else "")
    with tempfile.TemporaryDirectory(prefix="bench_decode_base_") as tmp:
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        archive = subprocess.run(["git", "-C", root, "archive", commit, "kvtier"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", src], input=archive.stdout, check=True)
        trees = {name_here: root, commit: src}
        print(f"# alternating {name_here} (this tree) and {commit}: model={model_dir or 'default'} "
              f"device={args.device} dtype={args.dtype} "
              f"threads={args.threads} steps={args.steps} warmup={args.warmup} "
              f"block_tokens: dense {args.block_tokens_dense}, sparse {args.block_tokens_sparse} "
              f"l1_fraction={args.l1_fraction} rounds={args.rounds}")
        print(f"{'context':>7} {'round':>5} {'tree':<9} {'config':<20} {'tok/s':>8} {'dyn tok/s':>9} {'x dyn':>6} "
              f"{'agree':>6} {'swapin/ls':>9} {'scratch/ls':>10}")
        runs: list[dict] = []
        for ctx in args.contexts:
            for rnd in range(args.rounds):
                order = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
                for tree in order:
                    out = os.path.join(tmp, f"{ctx}-{rnd}-{tree}.json")
                    cmd = child_argv(args, ctx, out, model_dir)
                    env = dict(os.environ, PYTHONPATH=trees[tree])
                    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    if r.returncode != 0:
                        raise SystemExit(f"the run of {tree} failed:\n{r.stderr[-3000:]}")
                    with open(out) as f:
                        rows = json.load(f)
                    for row in rows:
                        if row["config"] == "dynamic":
                            continue
                        dyn = next(x for x in rows if x["config"] == "dynamic")
                        run = {"context": ctx, "round": rnd, "tree": tree, "config": row["config"],
                               "tokens_per_s": row["tokens_per_s"], "dynamic_tokens_per_s": dyn["tokens_per_s"],
                               "speed_x_dynamic": row["speed_x_dynamic"], "token_agreement": row["token_agreement"],
                               "swap_ins_per_layer_step": row["swap_ins_per_layer_step"],
                               "scratch_per_layer_step": row["scratch_per_layer_step"]}
                        runs.append(run)
                        print(f"{ctx:>7} {rnd:>5} {tree:<9} {row['config']:<20} {row['tokens_per_s']:>8.2f} "
                              f"{dyn['tokens_per_s']:>9.2f} {row['speed_x_dynamic']:>6.2f} "
                              f"{row['token_agreement']:>6.2f} {row['swap_ins_per_layer_step']:>9.2f} "
                              f"{row['scratch_per_layer_step']:>10.2f}", flush=True)
        print("# median [min, max] of the runs' ratios to DynamicCache")
        summary = []
        for ctx in args.contexts:
            for config in [c for c in args.configs if c != "dynamic"]:
                for tree in trees:
                    mine = [r for r in runs if r["context"] == ctx and r["config"] == config and r["tree"] == tree]
                    xs = [r["speed_x_dynamic"] for r in mine]
                    med = statistics.median(xs)
                    # both rates too: a ratio can move with its denominator, DynamicCache's own rate
                    kv_rate = statistics.median(r["tokens_per_s"] for r in mine)
                    dyn_rate = statistics.median(r["dynamic_tokens_per_s"] for r in mine)
                    summary.append({"context": ctx, "config": config, "tree": tree, "median": med,
                                    "min": min(xs), "max": max(xs), "runs": len(xs),
                                    "median_tokens_per_s": kv_rate, "median_dynamic_tokens_per_s": dyn_rate})
                    print(f"# ctx {ctx} {config} {tree}: {med:.2f}x [{min(xs):.2f}, {max(xs):.2f}] over {len(xs)} runs; "
                          f"median tok/s {kv_rate:.2f}, DynamicCache {dyn_rate:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": name_here, "base": commit, "model": model_dir, "runs": runs, "summary": summary}, f, indent=1)
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked; ``dtype`` stays "auto" until :func:`main` resolves it."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny context and few steps (seconds)")
    ap.add_argument("--model", default=None,
                    help="embedded model name (smollm2-135m, the default: 8,192 positions; qwen2.5-coder-0.5b: "
                         "32,768), or a local transformers directory or .gguf file (kvtier.models.load_model)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--block-tokens", type=int, default=None,
                    help="tokens per block for every kvtier row (default: KVTierConfig's default for the row's "
                         "attention mode, 16 sparse and 64 dense, as a user who sets none gets)")
    # what the parent resolved, passed to --base children explicitly so an older tree's rows use
    # this tree's defaults (the same blocks on both sides)
    ap.add_argument("--block-tokens-dense", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--block-tokens-sparse", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--l1-fraction", type=float, default=0.25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["auto", *sorted(_DTYPES)], default="auto",
                    help="model dtype; auto: kvtier.hardware.compute_dtype (bf16 only on a CPU with native bf16)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: leave as is)")
    ap.add_argument("--configs", nargs="+",
                    default=list(BASELINE_CONFIGS) + [n for n in KVTIER_CONFIGS if n not in KVTIER_FIELDS])
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--prefill-cache", metavar="DIR", default=None,
                    help="keep DynamicCache's prefill of each context in DIR (safetensors, kvtier eval's format) "
                         "and reuse it in later runs and --base children: a 32k prefill is CPU-minutes; "
                         "kvtier's caches prefill through the model unless --fill-from-prefill")
    ap.add_argument("--fill-from-prefill", action="store_true",
                    help="with --prefill-cache: fill kvtier's caches too from the kept prefill (TieredCache.wrap, "
                         "as kvtier eval does) instead of prefilling each through the model")
    ap.add_argument("--base", metavar="REV", help="alternate this tree with git revision REV's kvtier (module doc)")
    ap.add_argument("--rounds", type=int, default=3, help="--base: runs per tree and context")
    ap.add_argument("--repeat", type=int, default=1,
                    help="passes over every configuration per context in this process, the order rotated each "
                         "pass; the ratios are taken within each pass and their median and range printed "
                         "(one pass's ratio moves by several percent on a shared CPU)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.contexts, args.steps, args.warmup, args.block_tokens = [128], 2, 1, 16
        # CI machines are small and shared: oversubscribed OpenMP threads are ~10x slower
        args.threads = args.threads or 1
    unknown = sorted(set(args.configs) - set(BASELINE_CONFIGS) - set(KVTIER_CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; allowed: {list(BASELINE_CONFIGS) + list(KVTIER_CONFIGS)}")
    if not 0 < args.l1_fraction <= 1:
        raise ValueError(f"--l1-fraction must be in (0, 1] (the share of the context in L1, the sparse budget); "
                         f"got {args.l1_fraction}")
    if args.prefill_cache is not None:
        args.prefill_cache = os.path.abspath(args.prefill_cache)
    elif args.fill_from_prefill:
        raise SystemExit("--fill-from-prefill needs --prefill-cache DIR (where the kept prefill is)")
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be >= 1; got {args.repeat}")
    if args.base and args.repeat > 1:
        raise SystemExit("--repeat is for one tree; with --base, --rounds alternates the trees")
    if args.base and args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1; got {args.rounds}")
    if args.block_tokens is not None and args.block_tokens < 1:
        raise SystemExit(f"--block-tokens must be >= 1; got {args.block_tokens}")
    resolve_block_tokens(args)
    # the reference every ratio needs, run first: the others are fed its tokens
    args.configs = ["dynamic"] + [c for c in args.configs if c != "dynamic"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dtype == "auto":
        from kvtier.hardware import compute_dtype

        args.dtype = str(compute_dtype(args.device)).removeprefix("torch.")
    model_dir = resolve_model(args.model, args.contexts)
    if args.base:
        return run_alternating(args, model_dir)
    if args.threads:
        torch.set_num_threads(args.threads)

    models = _kvtier_models()
    load_model, text_ids = models.load_model, models.text_ids

    device = torch.device(args.device)
    model, tok = load_model(model_dir, dtype=_DTYPES[args.dtype], device=device)
    rows = []
    print(f"# model={model_dir or 'default'} device={device} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"steps={args.steps} "
          f"warmup={args.warmup} block_tokens: dense {args.block_tokens_dense}, sparse {args.block_tokens_sparse} "
          f"l1_fraction={args.l1_fraction}")
    print(f"{'context':>7} {'config':<20} {'tok/s':>8} {'x dyn':>6} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'peak MB':>8} {'B/token':>8} {'x dyn':>6} {'agree':>6}")
    for ctx in args.contexts:
        ids = text_ids(tok, ctx, offset=1000).to(device)
        forced, runs = None, []
        for rep in range(args.repeat):
            # DynamicCache first in the first pass (the others decode its tokens, teacher-forced);
            # later passes rotate the order, so no configuration always runs on the warmest machine
            k = rep % len(args.configs)
            order = args.configs if rep == 0 else args.configs[k:] + args.configs[:k]
            by_name = {}
            for name in order:
                bt = row_block_tokens(args, name) if name in KVTIER_CONFIGS else None
                r = run_one(name, model, ids, args.steps, args.warmup, bt, args.l1_fraction,
                            None if name == "dynamic" else forced, args.prefill_cache, args.fill_from_prefill)
                if name == "dynamic" and forced is None:
                    forced = r["tokens"]
                by_name[name] = r
                r["model"] = model_dir
                r["repeat"] = rep
                rows.append(r)
            ref = by_name["dynamic"]
            for name in args.configs:
                r = by_name[name]
                r["speed_x_dynamic"] = r["tokens_per_s"] / ref["tokens_per_s"]
                r["bytes_x_dynamic"] = r["bytes_per_token"] / ref["bytes_per_token"]
                # each greedy choice against DynamicCache's at the same position, given the same text
                r["token_agreement"] = sum(a == b for a, b in zip(r["tokens"], ref["tokens"])) / len(ref["tokens"])
                print(f"{ctx:>7} {name:<20} {r['tokens_per_s']:>8.2f} {r['speed_x_dynamic']:>6.2f} "
                      f"{r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} {r['peak_mem_bytes'] / 2**20:>8.1f} "
                      f"{r['bytes_per_token']:>8.0f} {r['bytes_x_dynamic']:>6.2f} {r['token_agreement']:>6.2f}")
                if "swap_ins_per_layer_step" in r:
                    print(f"# {ctx} {name}: per layer and timed step, {r['swap_ins_per_layer_step']:.2f} swap-ins "
                          f"into L1, {r['scratch_per_layer_step']:.2f} scratch uses")
            runs.append(by_name)
        speed = {name: statistics.median(b[name]["speed_x_dynamic"] for b in runs) for name in args.configs}
        if args.repeat > 1:
            print(f"# ctx {ctx}: median [min, max] of the {args.repeat} passes' ratios to DynamicCache "
                  f"(each pass's ratio within the pass)")
            for name in args.configs[1:]:
                xs = [b[name]["speed_x_dynamic"] for b in runs]
                print(f"# ctx {ctx} {name}: {speed[name]:.2f}x [{min(xs):.2f}, {max(xs):.2f}]; median tok/s "
                      f"{statistics.median(b[name]['tokens_per_s'] for b in runs):.2f}, DynamicCache "
                      f"{statistics.median(b['dynamic']['tokens_per_s'] for b in runs):.2f}")
        last = runs[-1]
        target, quanto = last.get("kvtier-int4-sparse"), last.get("quanto-int4")
        if target is not None and quanto is not None:
            vs_q = statistics.median(b["kvtier-int4-sparse"]["tokens_per_s"] / b["quanto-int4"]["tokens_per_s"]
                                     for b in runs)
            ref = last["dynamic"]
            fewer = target["bytes_per_token"] < min(ref["bytes_per_token"], quanto["bytes_per_token"])
            ok = speed["kvtier-int4-sparse"] >= 1.0 and vs_q >= 1.3 and fewer
            print(f"# ctx {ctx}: kvtier-int4-sparse {speed['kvtier-int4-sparse']:.2f}x dynamic, {vs_q:.2f}x quanto-int4"
                  f"{' (medians)' if args.repeat > 1 else ''}, "
                  f"fewer bytes/token than both: {fewer} -> target (>=1.0x, >=1.3x, fewer) "
                  f"{'met' if ok else 'NOT met'}{'' if ctx >= 4096 else ' (target is stated at 4k)'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
