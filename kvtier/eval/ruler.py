"""RULER's synthetic tasks, generated and scored by RULER's own code (``nvidia-long-context-eval``).

The package ships RULER's generator scripts (``niah.py``, ``variable_tracking.py``, ...), their
task table (``synthetic.yaml``), the prompt templates (``data/synthetic/constants.py``), the
scoring functions (``eval/synthetic/constants.py``) and the data (Paul Graham essays, SQuAD,
HotpotQA). This module runs them as RULER's ``prepare.py`` does, in-process and offline:

    synthetic.yaml[task] + TASKS[kind]  ->  template (model template + task template + answer prefix)
    generator script main() with RULER's arguments  ->  {input, outputs, length} samples
    model output  ->  RULER's postprocess_pred  ->  RULER's metric_fn_per_sample

Two things are replaced because they would reach the network: nltk's punkt sentence splitter
(niah.py on essays; :func:`split_sentences` stands in) and nothing else is downloaded. The
``max_seq_length`` RULER generates for is the context length (prompt + generated tokens).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib
import importlib.util
import io
import json
import os
import random
import re
import sys
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path

_PACKAGE = "long_context_eval"
_INSTALL = "pip install --no-deps --require-hashes -r requirements/ruler.txt"
NIAH_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
              "niah_multikey_3", "niah_multivalue", "niah_multiquery")


def package_dir() -> Path:
    """Where RULER's package lies; never imported as a whole (its ``pred`` needs NeMo's stack)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"--suite ruler needs RULER's package {_PACKAGE!r}; install it with `{_INSTALL}`")
    return Path(list(spec.submodule_search_locations)[0])


def task_table() -> dict[str, dict]:
    """RULER's ``synthetic.yaml``: task name -> {"task": generator, "args": {...}}."""
    import yaml

    return yaml.safe_load((package_dir() / "synthetic.yaml").read_text())


def check_tasks(names: list[str]) -> list[str]:
    """The task names, each checked against RULER's table. Raises ValueError naming ``--tasks``."""
    table = task_table()
    bad = [n for n in names if n not in table]
    if bad:
        raise ValueError(f"--tasks: unknown RULER task(s) {bad}; RULER defines {sorted(table)}")
    if not names:
        raise ValueError(f"--tasks must name at least one RULER task of {sorted(table)}")
    for name in names:
        for need in _needs(table[name]):
            if not need.is_file():
                raise ValueError(f"--tasks {name}: RULER's {need.name} is missing ({need}); "
                                 f"reinstall RULER's package (`{_INSTALL}`)")
    return names


_DATASETS = {"squad": "squad.json", "hotpotqa": "hotpotqa.json"}


def _needs(config: dict) -> list[Path]:
    """The files a task's generator reads: its script, and the essays or QA set it draws from."""
    synthetic = package_dir() / "data" / "synthetic"
    args = config.get("args", {})
    needs = [synthetic / f"{config['task']}.py"]
    if args.get("type_haystack") == "essay":
        needs.append(synthetic / "json" / "PaulGrahamEssays.json")
    if args.get("dataset") in _DATASETS:
        needs.append(synthetic / "json" / _DATASETS[args["dataset"]])
    return needs


_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """A punkt-free sentence splitter: breaks after ``.``, ``!`` or ``?`` (closing quotes and
    brackets kept with the sentence) before whitespace and an upper-case letter, digit or quote.

    RULER only uses the sentences as places to insert needles, so the split need not match
    punkt's; it must only be deterministic and keep every character of the text.
    """
    parts = _SENTENCE_END.split(text)
    return [p for p in parts if p]


@dataclass(frozen=True)
class Sample:
    """One RULER sample: the prompt, the references, and how RULER scores it."""

    task: str
    index: int
    prompt: str
    outputs: list[str]
    max_new_tokens: int
    metric: str                          # RULER's metric: string_match_all | string_match_part
    input_ids: object = field(default=None, compare=False)  # [T] token ids (torch.LongTensor)


def _ruler_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.lru_cache(maxsize=1)
def _metrics():
    return _ruler_module("_ruler_eval_constants", package_dir() / "eval" / "synthetic" / "constants.py")


@functools.lru_cache(maxsize=1)
def _postprocess():
    """RULER's ``postprocess_pred`` taken from ``eval/evaluate.py`` without running that script
    (at import it parses arguments and downloads punkt)."""
    src = (package_dir() / "eval" / "evaluate.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "postprocess_pred")
    ns = {"re": re}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "long_context_eval/eval/evaluate.py", "exec"), ns)
    return ns["postprocess_pred"]


def score(sample_or_metric, prediction: str, outputs: list[str] | None = None) -> float:
    """RULER's per-sample score of ``prediction`` in [0, 1] (its percent / 100).

    Args:
        sample_or_metric: a :class:`Sample`, or a RULER generator kind (``"niah"``, ``"qa"``...).
        outputs: the references, when a kind is given.
    """
    if isinstance(sample_or_metric, Sample):
        kind, outputs = sample_or_metric.metric, sample_or_metric.outputs
    else:
        kind = sample_or_metric
    fn = _metrics().TASKS[kind]["metric_fn_per_sample"]
    pred = _postprocess()(prediction, {})
    return fn([pred], [outputs])[0] / 100.0


def chat_template(tokenizer) -> str:
    """A RULER model template (``{task_template}`` placeholder) from the tokenizer's chat template,
    as RULER's ``template.py`` holds one per chat format; ``base`` when the tokenizer has none."""
    if not getattr(tokenizer, "chat_template", None):
        return "{task_template}"
    mark = "\x00TASK\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=True)
    text = text.replace("{", "{{").replace("}", "}}")
    return text.replace(mark, "{task_template}")


@contextlib.contextmanager
def _generator_env(script_dir: Path):
    """What RULER's generator scripts expect around them, set up and taken down again: their
    sibling imports (``constants``, ``tokenizer``), nltk's ``sent_tokenize`` (local, no download),
    quiet stdout/stderr, and the global random state restored afterwards."""
    import numpy as np

    data = importlib.import_module(f"{_PACKAGE}.data.synthetic.constants")
    tok = importlib.import_module(f"{_PACKAGE}.data.tokenizer")
    nltk = types.ModuleType("nltk")
    nltk_tok = types.ModuleType("nltk.tokenize")
    nltk_tok.sent_tokenize = split_sentences
    nltk.tokenize = nltk_tok
    stand_ins = {"constants": data, "tokenizer": tok, "nltk": nltk, "nltk.tokenize": nltk_tok}
    saved = {k: sys.modules.get(k) for k in stand_ins}
    saved_argv, saved_path = sys.argv, list(sys.path)
    py_state, np_state = random.getstate(), np.random.get_state()
    sys.modules.update(stand_ins)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        sys.argv, sys.path[:] = saved_argv, saved_path
        random.setstate(py_state)
        np.random.set_state(np_state)


def generate(task: str, tokenizer, tokenizer_dir: Path, context: int, n: int, seed: int,
             template: str | None = None, cache_dir: Path | None = None) -> list[Sample]:
    """``n`` samples of RULER task ``task`` for a ``context``-token budget (prompt + answer).

    Args:
        tokenizer: the model's tokenizer (token ids of the prompts; chat template).
        tokenizer_dir: a local directory RULER's own ``hf`` tokenizer loads (its length search).
        seed: RULER's ``--random_seed`` (prepare.py uses 42 for the first chunk).
        template: RULER model template with ``{task_template}``; default :func:`chat_template`.
        cache_dir: where generated samples are kept (default ``<kvtier cache>/ruler``).
    """
    table = task_table()
    check_tasks([task])
    config = dict(table[task])
    kind = config["task"]
    base = importlib.import_module(f"{_PACKAGE}.data.synthetic.constants").TASKS[kind]
    model_template = template if template is not None else chat_template(tokenizer)
    full = model_template.format(task_template=base["template"]) + base.get("answer_prefix", "")
    script_dir = package_dir() / "data" / "synthetic"
    key = json.dumps([task, context, n, seed, full, Path(tokenizer_dir).name, _package_version()])
    cached = (cache_dir or _default_cache()) / f"{task}-{context}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsonl"
    if cached.is_file():
        return _samples(cached.read_text().splitlines(), task, kind, base, tokenizer)
    with tempfile.TemporaryDirectory(prefix="kvtier-ruler-") as tmp:
        argv = [f"{kind}.py", "--save_dir", tmp, "--save_name", task, "--subset", "validation",
                "--tokenizer_path", str(tokenizer_dir), "--tokenizer_type", "hf",
                "--max_seq_length", str(context), "--tokens_to_generate", str(base["tokens_to_generate"]),
                "--num_samples", str(n), "--random_seed", str(seed), "--template", full]
        for k, v in config["args"].items():
            argv += [f"--{k}", str(v)]
        if kind == "qa":
            argv += ["--pre_samples", "0"]
        with _generator_env(script_dir):
            sys.argv = argv
            sys.path[:0] = [str(script_dir), str(script_dir.parent)]
            # qa.py opens its dataset relative to the working directory's json/ folder
            with contextlib.chdir(script_dir):
                mod = _ruler_module(f"_ruler_gen_{kind}", script_dir / f"{kind}.py")
                mod.main()
        lines = (Path(tmp) / task / "validation.jsonl").read_text().splitlines()
    # generation is deterministic in its arguments (seeded), so its output is kept for reuse
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp_file = cached.with_suffix(".tmp")
    tmp_file.write_text("\n".join(lines) + "\n")
    os.chmod(tmp_file, 0o600)
    os.replace(tmp_file, cached)
    return _samples(lines, task, kind, base, tokenizer)


def _package_version() -> str:
    from importlib.metadata import version

    return version("nvidia-long-context-eval")


def _default_cache() -> Path:
    from kvtier.models import default_cache_dir

    return default_cache_dir() / "ruler"


def _samples(lines: list[str], task: str, kind: str, base: dict, tokenizer) -> list[Sample]:
    samples = []
    for line in lines:
        row = json.loads(line)
        ids = tokenizer(row["input"], add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        samples.append(Sample(task, int(row["index"]), row["input"], list(row["outputs"]),
                              int(base["tokens_to_generate"]), kind, ids.long()))
    return samples


def essays_text() -> str:
    """RULER's Paul Graham essays (the NIAH haystack), as one text for perplexity windows."""
    path = package_dir() / "data" / "synthetic" / "json" / "PaulGrahamEssays.json"
    if not path.is_file():
        raise ValueError(f"--text essays: {path} is missing; reinstall RULER's package (`{_INSTALL}`)")
    return json.loads(path.read_text())["text"]
