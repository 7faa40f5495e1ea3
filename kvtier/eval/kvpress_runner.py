"""kvpress's presses on kvtier eval's samples, run by the kvpress venv's python (``.venv-kvpress``).

This file imports nothing of kvtier: kvpress 0.5.5 pins transformers<5.3, so it runs in a venv
of its own, started by :mod:`kvtier.eval.kvpress_rows` as ``python -I kvpress_runner.py JOB OUT``
(``-I``: this file's directory, which holds kvtier's modules, is not put on ``sys.path``).

    JOB  (JSON): model directory, dtype, threads, stop token ids, the presses
                 ([{"name", "press", "compression_ratio", "compress_question"}]) and the samples
                 ([{"input_ids", "question_start", "max_new_tokens"}]: token ids exactly as kvtier
                 eval prefills them, split where RULER's question begins)
    OUT  (JSON lines): one line per (press, sample), written as each finishes:
                 {"name", "sample", "tokens", "prefill_s", "step_s", "kv_bytes" (entries attention
                  sees), "held_bytes" (entries the cache holds), "kept_tokens" (context tokens kept
                  per layer and KV head, mean), "context_tokens", "question_tokens"}

Each sample runs through kvpress's own pipeline (:class:`KVPressTextGenerationPipeline`
``._forward``): the press compresses the context during its prefill, the question is then
prefilled into the compressed cache uncompressed, and the answer is decoded greedily. Only
``generate_answer`` is extended, to time each decode step, stop on kvtier eval's stop tokens and
measure the cache before the pipeline trims the answer off it. Scoring is kvtier eval's (RULER's
own code), in the main venv.
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # KVzipPress loads the tokenizer by the model's path

import torch  # noqa: E402

PRESSES = {  # kvtier eval's press names -> kvpress classes (each with kvpress's default parameters)
    "snapkv": "SnapKVPress",
    "expected_attention": "ExpectedAttentionPress",
    "kvzip": "KVzipPress",
    "streaming_llm": "StreamingLLMPress",
    "none": None,  # kvpress's pipeline without a press: full attention through this venv's transformers
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_press(name: str, compression_ratio: float):
    import kvpress

    if name not in PRESSES:
        raise ValueError(f"press must be one of {sorted(PRESSES)}, got {name!r}")
    cls = PRESSES[name]
    return None if cls is None else getattr(kvpress, cls)(compression_ratio=compression_ratio)


def cache_bytes(model, cache) -> tuple[int, int, float]:
    """(bytes of K/V the cache holds, bytes of the entries attention can still see, mean tokens
    kept per layer and KV head). Head-wise presses (KVzip) do not shrink the cache: kvpress masks
    their evicted entries at attention time (``module.masked_key_indices``, its "fake
    compression"), so what they keep is the held entries less the masked ones."""
    held = kept = 0
    entries = 0.0
    for ly, layer in zip(cache.layers, model.model.layers):
        per_entry = (ly.keys.shape[-1] * ly.keys.element_size() + ly.values.shape[-1] * ly.values.element_size())
        n = ly.keys.shape[0] * ly.keys.shape[1] * ly.keys.shape[2]  # batch x kv_heads x tokens
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        m = 0 if masked is None else int(masked[0].numel())
        held += n * per_entry
        kept += (n - m) * per_entry
        entries += (n - m) / (ly.keys.shape[0] * ly.keys.shape[1])
    return held, kept, entries / len(cache.layers)


def timed_pipeline(model, tokenizer, stop_ids: set[int]):
    """kvpress's pipeline whose ``generate_answer`` also records what kvtier eval reports."""
    from kvpress import KVPressTextGenerationPipeline

    class Timed(KVPressTextGenerationPipeline):
        record: dict = {}

        def generate_answer(self, question_ids, cache, context_length, max_new_tokens):
            # the same steps as kvpress's generate_answer, timed one by one
            rec = self.record
            rec["prefill_s"] = time.perf_counter() - rec["t0"]  # the context's prefill and compression
            rec["kept_tokens"] = cache_bytes(self.model, cache)[2]
            t0 = time.perf_counter()
            position_ids = torch.arange(context_length, context_length + question_ids.shape[1],
                                        device=self.model.device).unsqueeze(0)
            out = self.model(input_ids=question_ids, past_key_values=cache, position_ids=position_ids,
                             logits_to_keep=1)
            rec["prefill_s"] += time.perf_counter() - t0  # the question's prefill: TTFT includes it
            position_ids = position_ids[:, -1:] + 1
            tokens, steps = [int(out.logits[0, -1].argmax())], []
            for i in range(max_new_tokens - 1):
                if tokens[-1] in stop_ids:
                    break
                t0 = time.perf_counter()
                out = self.model(input_ids=torch.tensor([[tokens[-1]]], device=self.model.device),
                                 past_key_values=cache, position_ids=position_ids + i)
                steps.append(time.perf_counter() - t0)
                tokens.append(int(out.logits[0, -1].argmax()))
            rec["held_bytes"], rec["kv_bytes"], _ = cache_bytes(self.model, cache)
            rec.update(tokens=tokens, step_s=steps)
            return tokenizer.decode(tokens, skip_special_tokens=True)

    return Timed(model=model, tokenizer=tokenizer)


@torch.inference_mode()
def main(job_path: str, out_path: str) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    import kvpress  # noqa: F401  (first: it patches transformers' attention functions for head-wise presses)

    job = json.loads(open(job_path).read())
    torch.set_num_threads(int(job["threads"]))
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=DTYPES[job["dtype"]], local_files_only=True,
                                                 attn_implementation="sdpa")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"], local_files_only=True)
    eos = model.generation_config.eos_token_id
    stop = set(job["stop_ids"]) | set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    pipe = timed_pipeline(model, tokenizer, stop)
    presses = [(p["name"], make_press(p["press"], float(p["compression_ratio"])), bool(p.get("compress_question")))
               for p in job["presses"]]
    with open(out_path, "a") as out:
        for i, s in enumerate(job["samples"]):
            ids = torch.tensor(s["input_ids"], dtype=torch.long).view(1, -1)
            for name, press, compress_question in presses:
                # compress_question: the press sees (and compresses) the question with the context;
                # only the prompt's last token is prefilled after it, to give the first answer token
                k = ids.shape[1] - 1 if compress_question else int(s["question_start"])
                pipe.record.clear()
                pipe.record["t0"] = time.perf_counter()
                pipe._forward({"context_ids": ids[:, :k], "questions_ids": [ids[:, k:]]},
                              max_new_tokens=int(s["max_new_tokens"]), press=press, cache=DynamicCache())
                r = pipe.record
                row = {"name": name, "sample": i, "tokens": r["tokens"], "prefill_s": r["prefill_s"],
                       "step_s": r["step_s"], "kv_bytes": r["kv_bytes"], "held_bytes": r["held_bytes"],
                       "kept_tokens": r["kept_tokens"],
                       "context_tokens": k, "question_tokens": ids.shape[1] - k}
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(f"kvpress: sample {i + 1}/{len(job['samples'])} {name}: prefill {r['prefill_s']:.1f} s, "
                      f"kept {r['kept_tokens']:.0f}/{k} context tokens, {len(r['tokens'])} tokens",
                      file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -I kvpress_runner.py JOB.json OUT.jsonl", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
