"""`kvtier eval`: options -> checks -> tasks (text windows or RULER samples) -> runs -> rows -> outputs.

Every option, every configuration row and the text's length are checked before the model loads
(a mistake costs a second, not a model load); errors are sentences naming the option, exit code 2.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import random
import tempfile
import time
from pathlib import Path

from kvtier.hardware import DTYPE_CHOICES, cpu_has_native_bf16, cpu_name, parse_dtype
from kvtier.eval.sweep import (
    check_configs,
    demo_configs,
    full_configs,
    load_configs,
    quick_configs,
    ruler_configs,
    summarise,
    with_reference,
)

QUICK = {"contexts": [1024], "continuation": 32, "windows": 1}
DEFAULT = {"contexts": [1024, 2048, 4096], "continuation": 64, "windows": 2}
RULER_DEFAULT = {"contexts": [8192], "samples": 4}
# two samples keep `make demo` within ~5 minutes on a 2-core CPU without native bf16 (float32
# there); `--samples N` is the longer run
DEMO = {"model": "qwen2.5-coder-0.5b", "contexts": [8192], "samples": 2, "tasks": ["niah_single_2"]}
TEXTS = ("pydoc", "essays")


def _int_list(s: str) -> list[int]:
    from kvtier.commands.cliargs import token_list

    try:
        vals = token_list(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--contexts must be comma-separated token counts (8192,16k), "
                                         f"got {s!r}") from None
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
    from kvtier.eval.ruler import NIAH_TASKS

    p.add_argument("--suite", choices=("text", "ruler"), default="text",
                   help="text: perplexity/KL/top-1 on text windows plus the recall probe; "
                        "ruler: RULER's synthetic tasks, generated and scored by RULER's own code")
    p.add_argument("--quick", action="store_true",
                   help=f"small text sweep that finishes in about 5 minutes on 2 cores ({QUICK})")
    p.add_argument("--demo", action="store_true",
                   help=f"the product's point in a few minutes: RULER {DEMO['tasks'][0]} at {DEMO['contexts'][0]} "
                        f"tokens on Qwen2.5-Coder-0.5B, {DEMO['samples']} samples (--samples N for more), "
                        "full attention vs StreamingLLM vs kvtier sparse at 3%%")
    p.add_argument("--model", default=None,
                   help="embedded model name (smollm2-135m, the default; qwen2.5-coder-0.5b), "
                        "or a local transformers directory or .gguf file")
    p.add_argument("--text", default=None,
                   help="text of the text suite: 'pydoc' (default: pydoc_data.topics), 'essays' "
                        "(RULER's Paul Graham essays) or a UTF-8 file")
    p.add_argument("--contexts", type=_int_list, default=None, help="context lengths, e.g. 8192,16k,32k")
    p.add_argument("--continuation", type=_positive("--continuation", 2, 4096), default=None,
                   help="text suite: teacher-forced decode steps per window")
    p.add_argument("--windows", type=_positive("--windows", 1, 1000), default=None,
                   help="text suite: text windows (and as many recall-probe windows) per context")
    p.add_argument("--tasks", default=",".join(NIAH_TASKS),
                   help="ruler suite: comma-separated RULER tasks (default: the NIAH family) and/or long-answer "
                        "extraction tasks (extract_hex, extract_b32, extract_digits, extract_words, extract_multi)")
    p.add_argument("--extract-density", type=float, default=None, metavar="FRACTION",
                   help="ruler suite, extraction tasks: share of the haystack's tokens in records, the rest "
                        "essay text between them (default 0.1; 1.0: records only, hundreds of look-alikes)")
    p.add_argument("--samples", type=_positive("--samples", 1, 500), default=None,
                   help=f"ruler suite: samples per task and context (default {RULER_DEFAULT['samples']})")
    p.add_argument("--max-new-tokens", type=_positive("--max-new-tokens", 1, 4096), default=None,
                   help="ruler suite: cap on generated tokens (default: each task's RULER limit)")
    p.add_argument("--fidelity", action="store_true",
                   help="ruler suite: each configuration also replays the reference's answer on a fresh cache "
                        "and reports its mean KL from the reference's next-token distribution and the share of "
                        "steps whose top token is the reference's (every step counts, not only the final "
                        "score; doubles the decode time of each configuration)")
    p.add_argument("--configs", default=None, help="TOML file of [[config]] tables (see kvtier/eval/sweep.py)")
    p.add_argument("--anchors", choices=("kvpress",), default=None,
                   help="ruler suite: add kvpress's presses (SnapKV, ExpectedAttention, KVzip, StreamingLLM at "
                        "3%% of the context, and its pipeline without a press) as anchor rows, run by kvpress's own "
                        "code in its own venv (`make kvpress-venv`: kvpress pins transformers<5.3) on the same samples")
    p.add_argument("--only", default=None, help="comma-separated substrings: keep configs whose name contains one")
    p.add_argument("--no-probe", action="store_true", help="skip the recall-probe windows")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="model and KV dtype; auto: bfloat16 on a CPU with native bf16 matmul (AVX512_BF16, AMX, "
                        "Arm BF16), float32 on any other CPU (bf16 is emulated there, several times slower)")
    p.add_argument("--threads", type=_positive("--threads", 1, 1024), default=None,
                   help="torch threads (default: torch's choice, the physical cores)")
    p.add_argument("--prefill-cache", default=None, metavar="DIR",
                   help="keep each sample's shared prefill in DIR (safetensors) and reuse it on later runs "
                        "of the same model, dtype and sample (a 32k prefill is tens of CPU-minutes); "
                        "TTFT then reports the prefill's time when it was computed")
    p.add_argument("--seed", type=int, default=0, help="seed of the text windows, the samples and sampling (default 0)")
    p.add_argument("--out", default="results", help="output directory for eval.json, eval.png and eval.md")
    p.add_argument("--merge", nargs="+", metavar="DIR", default=None,
                   help="no run: pool the samples of finished (or stopped) ruler runs in these --out "
                        "directories into one table in --out, accuracy and intervals recomputed over all "
                        "samples (kvtier/eval/merge.py); takes no other option")


class _Plan:
    """The checked options: what the run will do, settled before any model loads."""

    def __init__(self, args: argparse.Namespace):
        from kvtier.models import MODELS, resolve_model

        if args.demo:
            args.suite = "ruler"
            args.model = args.model or DEMO["model"]
            args.tasks = ",".join(DEMO["tasks"])
            args.contexts = args.contexts or DEMO["contexts"]
            args.samples = args.samples or DEMO["samples"]
        self.suite = args.suite
        path, embedded = resolve_model(args.model)
        if path is not None and not Path(path).expanduser().exists():
            raise ValueError(f"--model {path!r} is neither an embedded model ({', '.join(MODELS)}) nor an existing path")
        self.embedded = embedded
        self.max_positions = embedded.max_positions if embedded else _positions_of(path)
        preset = QUICK if args.quick else (RULER_DEFAULT if self.suite == "ruler" else DEFAULT)
        self.contexts = args.contexts or preset["contexts"]
        if self.max_positions is not None:
            too_long = [c for c in self.contexts if c > self.max_positions]
            if too_long:
                raise ValueError(f"--contexts {too_long} exceed the model's {self.max_positions:,} positions "
                                 f"(--model {args.model or 'smollm2-135m'})")
        text_preset = QUICK if args.quick else DEFAULT
        self.continuation = args.continuation or text_preset["continuation"]
        self.windows = args.windows or text_preset["windows"]
        self.samples = args.samples or RULER_DEFAULT["samples"]
        self.text = self._check_text(args.text)
        if self.suite == "ruler":
            from kvtier.eval import extract, ruler

            names = [t.strip() for t in args.tasks.split(",") if t.strip()]
            theirs = [t for t in names if t not in extract.EXTRACT_TASKS]
            if theirs or not names:
                ruler.check_tasks(theirs)
            self.tasks = names
        else:
            self.tasks = []
        if getattr(args, "fidelity", False) and self.suite != "ruler":
            raise ValueError("--fidelity needs --suite ruler (the text suite teacher-forces every window and "
                             "reports KL and top-1 agreement already)")
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {args.out}: exists and is not a directory (eval writes eval.json, eval.png and "
                             "eval.md into a directory)")
        self.out = out
        self.prefill_cache = Path(args.prefill_cache) if args.prefill_cache else None
        if self.prefill_cache is not None and self.prefill_cache.exists() and not self.prefill_cache.is_dir():
            raise ValueError(f"--prefill-cache {args.prefill_cache}: exists and is not a directory")
        if args.configs:
            specs = load_configs(args.configs)
        elif self.suite == "ruler":
            specs = demo_configs() if args.demo else ruler_configs()
        else:
            specs = quick_configs() if args.quick else full_configs()
        if args.anchors == "kvpress":
            from kvtier.eval.kvpress_rows import kvpress_configs

            specs = specs + kvpress_configs()
        self.kvpress_python = None
        if any(s.kind == "kvpress" for s in specs):
            if self.suite != "ruler":
                raise ValueError("kvpress rows (--anchors kvpress, or kind = \"kvpress\" in --configs) need "
                                 "--suite ruler: they decode RULER answers through kvpress's pipeline")
            from kvtier.eval.kvpress_rows import venv_python

            self.kvpress_python = venv_python()  # its absence is a sentence now, not after the model loads
        if args.only:
            keep = [s.strip() for s in args.only.split(",") if s.strip()]
            chosen = [s for s in specs if s.kind != "dynamic" and any(k in s.name for k in keep)]
            if not chosen:
                raise ValueError(f"--only {args.only!r} matches no configuration; the names are "
                                 f"{[s.name for s in specs if s.kind != 'dynamic']}")
            specs = [s for s in specs if s.kind == "dynamic"] + chosen
        check_configs(specs, self.contexts, where=f"--configs {args.configs}: " if args.configs else "")
        self.ref, self.specs = with_reference(specs)
        try:
            # made last of the checks, before the model loads: an unwritable place costs a second
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--out {args.out}: cannot create the directory ({e.strerror or e})") from None

    @staticmethod
    def _check_text(text: str | None) -> str | None:
        if text is None or text in TEXTS:
            return text
        p = Path(text)
        if not p.is_file():
            raise ValueError(f"--text {text}: no such file (or use one of {TEXTS})")
        try:
            p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--text {text}: cannot read it as UTF-8 text ({e})") from None
        return text


def _positions_of(path: str) -> int | None:
    """The positions a local model takes, read before it loads: max_position_embeddings of a
    transformers directory, or ``<architecture>.context_length`` of a .gguf file's metadata
    (memory-mapped, no tensor read). None when neither says."""
    import json

    p = Path(path).expanduser()
    cfg = p / "config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text()).get("max_position_embeddings")
    if p.is_file() and p.suffix == ".gguf":
        return _gguf_context_length(p)
    return None


def _gguf_context_length(path: Path) -> int | None:
    from gguf import GGUFReader

    try:
        fields = GGUFReader(str(path)).fields
        arch_field = fields["general.architecture"]
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
        ctx = fields.get(f"{arch}.context_length")
        return int(ctx.parts[ctx.data[0]][0]) if ctx is not None else None
    except (KeyError, ValueError, OSError, IndexError) as e:
        raise ValueError(f"--model {path}: cannot read it as a GGUF file ({type(e).__name__}: {e})") from None


def _load_text(name: str | None) -> str:
    from kvtier.eval import ruler
    from kvtier.models import load_text

    if name in (None, "pydoc"):
        return load_text()
    if name == "essays":
        return ruler.essays_text()
    return Path(name).read_text(encoding="utf-8")


def run(args: argparse.Namespace) -> int:
    if args.merge:
        return _merge(args)
    plan = _Plan(args)  # every check before anything heavy is imported or loaded

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvtier import __version__
    from kvtier.eval import kvpress_rows, report, ruler
    from kvtier.eval.caches import warm_up
    from kvtier.eval.data import probe_windows, text_windows, tokenize
    from kvtier.eval.runner import run_all
    from kvtier.models import load_model, load_tokenizer, model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=max(150, Console().width))
    t_start = time.perf_counter()

    def say(msg: str) -> None:
        # rich draws its status spinners and bars only on a terminal; a log or a pipe gets these
        # lines instead, flushed, so a long run never looks hung
        if not console.is_terminal:
            print(f"[{time.perf_counter() - t_start:5.0f} s] {msg}", flush=True)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    # tasks first (the tokenizer alone loads in a second): a text too short fails before the model
    tok = load_tokenizer(args.model)
    tasks: dict[int, list] = {}
    say("building tasks")
    with console.status("building tasks"):
        if plan.suite == "text":
            text = _load_text(plan.text)
            ids = tokenize(tok, text)
            for ctx in plan.contexts:
                windows = text_windows(ids, ctx, plan.continuation, plan.windows, seed=args.seed)
                if not args.no_probe:
                    windows += probe_windows(tok, text, ids, ctx, plan.windows, seed=args.seed)
                tasks[ctx] = windows
        else:
            from kvtier.config import default_block_tokens
            from kvtier.eval import extract

            tok_dir = model_dir(args.model)
            density = extract.DENSITY if args.extract_density is None else args.extract_density
            for ctx in plan.contexts:
                tasks[ctx] = [s for task in plan.tasks
                              for s in (extract.generate(task, tok, ctx, plan.samples, seed=42 + args.seed,
                                                         block_tokens=default_block_tokens("sparse"),
                                                         density=density)
                                        if task in extract.EXTRACT_TASKS else
                                        ruler.generate(task, tok, tok_dir, ctx, plan.samples, seed=42 + args.seed))]
    dtype = parse_dtype(args.dtype)
    say(f"loading model in {str(dtype).removeprefix('torch.')} (CPU: {cpu_name()}, native bf16 matmul: "
        f"{cpu_has_native_bf16()})")
    with console.status("loading model"):
        model, tok = load_model(args.model, dtype=dtype)
        model.eval()
        warm_up(model)
    cfg = model.config
    if plan.max_positions is None and max(plan.contexts) > cfg.max_position_embeddings:
        raise ValueError(f"--contexts {max(plan.contexts)} exceeds the model's {cfg.max_position_embeddings:,} positions")
    label = plan.embedded.label if plan.embedded else args.model
    model_info = {"name": label, "layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
                  "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                  "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                  "max_positions": cfg.max_position_embeddings, "threads": torch.get_num_threads(),
                  "cpu": cpu_name(), "native_bf16": cpu_has_native_bf16()}
    specs = [plan.ref] + plan.specs
    console.print(f"{plan.suite} suite: contexts {plan.contexts}; "
                  + (f"tasks {plan.tasks}, {plan.samples} samples each" if plan.suite == "ruler" else
                     f"continuation {plan.continuation}, {plan.windows} text + "
                     f"{0 if args.no_probe else plan.windows} probe windows")
                  + f"; {len(plan.specs)} configurations + reference, one shared prefill per sample")

    settings = {"suite": plan.suite, "contexts": plan.contexts, "seed": args.seed, "quick": bool(args.quick),
                "demo": bool(args.demo)}
    if plan.suite == "text":
        settings.update({"continuation": plan.continuation, "windows": plan.windows, "probe": not args.no_probe,
                         "text": plan.text or "pydoc"})
    else:
        settings.update({"tasks": plan.tasks, "samples": plan.samples, "max_new_tokens": args.max_new_tokens,
                         "fidelity": bool(args.fidelity)})
    settings["prefill_cache"] = plan.prefill_cache is not None
    doc = {
        "schema": report.SCHEMA, "kvtier_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": model_info, "settings": settings, "reference": plan.ref.name,
    }
    plan.out.mkdir(parents=True, exist_ok=True)

    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="kvtier-eval-") as tmp, Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console,
    ) as progress:
        in_process = [s for s in specs if s.kind != "kvpress"]
        external = [s for s in specs if s.kind == "kvpress"]
        for ctx in plan.contexts:
            samples = tasks[ctx]
            bar = progress.add_task(f"context {ctx}", total=len(samples) * len(specs))
            per_spec: list[list] = [[] for _ in specs]

            def tick(r, bar=bar, ctx=ctx):
                name = getattr(r, "spec", None) and r.spec.name
                progress.update(bar, advance=1, description=f"context {ctx}: {name}")
                say(f"context {ctx}: {name or 'a configuration'} done "
                    f"({progress.tasks[bar].completed:.0f}/{progress.tasks[bar].total:.0f})")

            for done, sample in enumerate(samples, 1):
                pressed = {}
                if external:
                    # one run of the kvpress venv per sample (a model load is seconds, a prefill
                    # minutes), so the partial results written after each sample hold every row
                    pressed = kvpress_rows.run(external, [sample], tok, model_dir(args.model),
                                               str(dtype).removeprefix("torch."), torch.get_num_threads(),
                                               args.max_new_tokens, say=progress.console.print)
                    progress.update(bar, advance=len(external))
                ran = iter(run_all(model, in_process, sample, Path(tmp), tokenizer=tok,
                                   max_new_tokens=args.max_new_tokens, on_result=tick,
                                   prefill_cache=plan.prefill_cache, fidelity=args.fidelity))
                results = [pressed[s.name][0] if s.kind == "kvpress" else next(ran) for s in specs]
                for i, r in enumerate(results):
                    per_spec[i].append(r)
                ref = per_spec[0]
                if any(not hasattr(r, "spec") for r in ref):
                    raise RuntimeError(f"the reference {plan.ref.name!r} could not run: {ref[0]}")
                ctx_rows, ctx_skipped = _rows(specs, per_spec, ctx, args.seed)
                line = "; ".join(f"{r.spec.name} {r.score if r.score is not None else '-'}" for r in results
                                 if hasattr(r, "spec"))
                progress.console.print(f"context {ctx}: sample {done}/{len(samples)} "
                                       f"({getattr(sample, 'task', 'text')}) at {time.perf_counter() - t_start:.0f} s, "
                                       f"prefill {ref[-1].prefill_s:.0f} s: {line}")
                if done < len(samples):
                    # a long run keeps what it has measured: eval.json and eval.md after every
                    # sample, marked partial, so a run stopped early still leaves its figures
                    doc.update(partial={"context": ctx, "samples_done": done, "samples": len(samples)},
                               elapsed_s=time.perf_counter() - t_start, results=rows + ctx_rows,
                               skipped=skipped + ctx_skipped)
                    _write(doc, plan.out, plot=False)
            for s in ctx_skipped:
                console.print(f"[yellow]skipped {s['config']}: {s['reason']}")
            rows += ctx_rows
            skipped += ctx_skipped

    doc.pop("partial", None)
    doc.update(elapsed_s=time.perf_counter() - t_start, results=rows, skipped=skipped)
    report.print_table(doc, console)
    _write(doc, plan.out)
    console.print(f"wrote {plan.out / 'eval.json'}, {plan.out / 'eval.png'}, {plan.out / 'eval.md'} "
                  f"in {doc['elapsed_s']:.0f} s")
    return 0


def _rows(specs, per_spec: list[list], ctx: int, seed: int) -> tuple[list[dict], list[dict]]:
    """One context's rows from the results so far, and the configurations this machine skipped."""
    rows, skipped = [], []
    ref = per_spec[0]
    for spec, got in zip(specs, per_spec):
        bad = [r for r in got if not hasattr(r, "spec")]
        if bad:
            skipped.append({"config": spec.name, "context": ctx, "reason": str(bad[0])})
            continue
        rows.append(summarise(spec, ctx, ref, got, seed=seed))
    return rows, skipped


def _merge(args: argparse.Namespace) -> int:
    """--merge: the runs in ``args.merge`` as one, written to ``args.out`` (no model loaded)."""
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    defaults = vars(p.parse_args([]))
    given = sorted(k for k, v in defaults.items() if k not in ("merge", "out") and getattr(args, k, v) != v)
    if given:
        raise ValueError(f"--merge takes no other option than --out (it runs nothing); got "
                         f"{', '.join('--' + k.replace('_', '-') for k in given)}")
    from rich.console import Console

    from kvtier.eval import report
    from kvtier.eval.merge import merge_dirs

    out = Path(args.out)
    if out.resolve() in {Path(d).resolve() for d in args.merge}:
        raise ValueError(f"--out {args.out} is one of the --merge directories; the merged run goes elsewhere")
    doc = merge_dirs([Path(d) for d in args.merge])
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=max(150, Console().width))
    report.print_table(doc, console)
    _write(doc, out)
    console.print(f"merged {len(args.merge)} runs into {out / 'eval.json'}, {out / 'eval.png'}, {out / 'eval.md'}")
    return 0


def _write(doc: dict, out: Path, plot: bool = True) -> None:
    """eval.json and eval.md (and eval.png) into ``out``; each file replaced whole, never half written."""
    import os

    from kvtier.eval import report

    tmp_json, tmp_md = out / ".eval.json.tmp", out / ".eval.md.tmp"
    report.write_json(doc, tmp_json)
    tmp_md.write_text(report.markdown_table(doc) + "\n")
    os.replace(tmp_json, out / "eval.json")
    os.replace(tmp_md, out / "eval.md")
    if plot:
        report.plot(doc, out / "eval.png")

