"""kvpress's presses as anchor rows of `kvtier eval`, run in their own venv on the same samples.

kvpress (NVIDIA) is what the KV-compression literature compares against; 0.5.5 pins
transformers<5.3, and on the main venv's transformers its presses fail at run time. So its rows
are measured by ``kvtier/eval/kvpress_runner.py`` under ``.venv-kvpress/bin/python`` (``make
kvpress-venv``), and nothing in this venv imports kvpress:

    RULER samples (token ids, as every other row prefills them)
      -> split where RULER's question begins (context | question + answer prefix)
      -> job.json -> kvpress venv: kvpress's pipeline, press on the context, greedy decode
      -> out.jsonl (tokens, timings, cache bytes) -> decoded and scored here by RULER's code
      -> runner.Result per sample -> sweep.summarise: rows in the same table as the others

The split follows kvpress's own protocol (its pipeline takes a context and a question): the press
compresses the context during prefill, the question is prefilled uncompressed into the
compressed cache. The budget is kvpress's ``compression_ratio = 1 - budget_fraction`` of the
context's tokens; the question's tokens come on top and count in the row's bytes per token.
With ``compress_question = true`` the press sees the question as part of the context (what
kvtier's own rows and SnapKV's paper do: query-aware); only the prompt's last token follows it.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from kvtier.eval.caches import CacheSpec
from kvtier.eval.runner import Result, stop_tokens

# kvtier eval's press names (the runner maps them to kvpress classes) and their row labels
PRESSES = {
    "snapkv": "kvpress SnapKV",
    "expected_attention": "kvpress ExpectedAttention",
    "kvzip": "kvpress KVzip",
    "streaming_llm": "kvpress StreamingLLM",
    "none": "kvpress full (no press)",
}
DEFAULT_PRESSES = ("none", "snapkv", "expected_attention", "kvzip", "streaming_llm")
VENV_ENV = "KVTIER_KVPRESS_PYTHON"
_RUNNER = Path(__file__).with_name("kvpress_runner.py")
_BUILD = "make kvpress-venv"


def kvpress_configs(fraction: float = 0.03, presses=DEFAULT_PRESSES) -> list[CacheSpec]:
    """``--anchors kvpress``: kvpress's presses at ``fraction`` of the context kept (and its
    pipeline without a press, the same full attention through kvpress's transformers)."""
    out = []
    for p in presses:
        name = PRESSES[p] if p == "none" else f"{PRESSES[p]} {fraction:.1%}"
        out.append(CacheSpec(name, "kvpress", {"press": p} if p == "none" else {"press": p, "budget_fraction": fraction}))
    return out


def compression_ratio(spec: CacheSpec) -> float:
    """kvpress's ``compression_ratio``: the fraction of the context's tokens a press removes."""
    return 0.0 if spec.params["press"] == "none" else 1.0 - float(spec.params.get("budget_fraction", 0.03))


def venv_python() -> Path:
    """The kvpress venv's python: ``$KVTIER_KVPRESS_PYTHON``, else ``.venv-kvpress`` at the
    repository root. ValueError saying how to build it when neither exists."""
    env = os.environ.get(VENV_ENV)
    path = Path(env) if env else Path(__file__).resolve().parents[2] / ".venv-kvpress" / "bin" / "python"
    if not path.is_file():
        raise ValueError(f"--anchors kvpress runs kvpress in its own venv (it pins transformers<5.3), and "
                         f"{path} does not exist: build it with `{_BUILD}` in the repository, or point "
                         f"${VENV_ENV} at a python that has kvpress==0.5.5")
    return path


def question_start(sample, tokenizer) -> int:
    """Index of the first token of ``sample``'s question: the last line of the prompt that
    starts with the first word after ``{context}`` in RULER's template (``What``, ``Question:``,
    ``Answer``; RULER's generators reword the rest, e.g. single-needle niah). The ids are
    ``sample.input_ids``, so the split keeps exactly the tokens every other row prefills."""
    import importlib

    from kvtier.eval import ruler

    template = importlib.import_module(f"{ruler._PACKAGE}.data.synthetic.constants").TASKS[sample.metric]["template"]
    marker = "\n" + template.split("{context}", 1)[1].split()[0]
    at = sample.prompt.rfind(marker)
    assert at >= 0, f"RULER {sample.task}: no line starting {marker[1:]!r} in the prompt"
    enc = tokenizer(sample.prompt, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == sample.input_ids.tolist(), "the prompt's tokens differ from the sample's"
    return next(i for i, (start, _) in enumerate(enc["offset_mapping"]) if start >= at + 1)


def job(specs: list[CacheSpec], samples: list, tokenizer, model_dir: Path, dtype: str, threads: int,
        max_new_tokens: int | None = None) -> dict:
    """The runner's job: what to load, which presses, and every sample split at its question."""
    return {
        "model_dir": str(model_dir), "dtype": dtype, "threads": threads, "stop_ids": sorted(stop_tokens(tokenizer)),
        "presses": [{"name": s.name, "press": s.params["press"], "compression_ratio": compression_ratio(s),
                     "compress_question": bool(s.params.get("compress_question", False))} for s in specs],
        "samples": [{"input_ids": s.input_ids.tolist(), "question_start": question_start(s, tokenizer),
                     "max_new_tokens": max_new_tokens or s.max_new_tokens} for s in samples],
    }


def results(specs: list[CacheSpec], samples: list, lines: list[str], tokenizer) -> dict[str, list]:
    """The runner's output as :class:`runner.Result` lists, one per spec in sample order; each
    prediction decoded and scored as the in-process rows are."""
    from kvtier.eval import ruler

    stop = stop_tokens(tokenizer)
    by_spec = {s.name: s for s in specs}
    got: dict[str, dict[int, Result]] = {s.name: {} for s in specs}
    for line in lines:
        row = json.loads(line)
        spec, sample = by_spec[row["name"]], samples[row["sample"]]
        text = tokenizer.decode([t for t in row["tokens"] if t not in stop], skip_special_tokens=True)
        tokens = sample.input_ids.numel() + max(1, len(row["step_s"]))
        # bytes of the entries attention sees; KVzip's evicted entries are masked, not freed, by
        # kvpress (held_bytes_per_token says what its cache really holds)
        b, held = float(row["kv_bytes"]), float(row.get("held_bytes", row["kv_bytes"]))
        footprint = {"l1_bytes_per_token": b / tokens, "l2_bytes_per_token": 0.0, "l3_bytes_per_token": 0.0,
                     "total_bytes_per_token": b / tokens, "peak_l1_bytes": held,
                     "held_bytes_per_token": held / tokens, "kept_context_tokens": float(row["kept_tokens"])}
        got[spec.name][row["sample"]] = Result(spec, sample, list(row["step_s"]), float(row["prefill_s"]), 0.0,
                                               footprint, {}, prediction=text, score=ruler.score(sample, text),
                                               tokens=list(row["tokens"]))
    missing = [(name, i) for name, per in got.items() for i in range(len(samples)) if i not in per]
    if missing:
        raise RuntimeError(f"the kvpress runner returned no result for {missing[:4]} (of {len(missing)} missing)")
    return {name: [per[i] for i in range(len(samples))] for name, per in got.items()}


def run(specs: list[CacheSpec], samples: list, tokenizer, model_dir: Path, dtype: str, threads: int,
        max_new_tokens: int | None = None, say=print) -> dict[str, list]:
    """Every kvpress spec on every sample in one run of the kvpress venv (one model load).

    Returns ``{spec name: [runner.Result per sample]}``; RuntimeError with the runner's last
    output when it fails.
    """
    python = venv_python()
    with tempfile.TemporaryDirectory(prefix="kvtier-kvpress-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.jsonl"
        job_path.write_text(json.dumps(job(specs, samples, tokenizer, model_dir, dtype, threads, max_new_tokens)))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # none of the main venv's modules
        env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        proc = subprocess.Popen([str(python), "-I", str(_RUNNER), str(job_path), str(out_path)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail: list[str] = []
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-30:]
            if line.startswith("kvpress: "):
                say(line)
        if proc.wait() != 0:
            raise RuntimeError(f"the kvpress runner ({python}) failed with exit code {proc.returncode}:\n"
                               + "\n".join(tail))
        return results(specs, samples, out_path.read_text().splitlines(), tokenizer)
