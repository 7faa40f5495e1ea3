"""Engine helpers shared by the vLLM tests (and nothing else)."""
from __future__ import annotations

import contextlib
import gc
import struct
from pathlib import Path

MAX_TOKENS = 16


@contextlib.contextmanager
def engine(model_dir: str, prefix_caching: bool = False, log_stats: bool = False,
           engine_args: dict | None = None, **fields):
    """A vLLM ``LLM`` with kvtier's connector configured by ``fields`` (and more ``LLM``
    arguments in ``engine_args``); shut down on exit. ``log_stats``: vLLM's stats loggers on
    (its Prometheus registry, ``llm.get_metrics()``)."""
    from vllm import LLM

    from kvtier.vllm import kv_transfer_config

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=2048,
              enable_prefix_caching=prefix_caching, seed=0, kv_transfer_config=kv_transfer_config(**fields),
              disable_log_stats=not log_stats, **(engine_args or {}))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def engine_id(llm) -> str:
    return llm.llm_engine.vllm_config.kv_transfer_config.engine_id


def worker(llm, op: str) -> dict:
    from kvtier.vllm import worker_call

    return worker_call(engine_id(llm), op)


def run(llm, prompt: list[int], load: bool = True, save: bool = True, max_tokens: int = MAX_TOKENS,
        cache_salt: str | None = None, lora=None):
    """Greedy generation of one prompt (with vLLM's ``cache_salt`` and ``LoRARequest`` when
    given); returns ``(token ids, kvtier's matched tokens, vLLM's cached tokens)``.

    ``load=False, save=False`` is a cold run: kvtier neither supplies nor stores anything."""
    from vllm import SamplingParams

    extra = {} if load and save else {"kv_transfer_params": {"kvtier": {"load": load, "save": save}}}
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra or None)
    inputs = {"prompt_token_ids": prompt}
    if cache_salt is not None:
        inputs["cache_salt"] = cache_salt
    out = llm.generate([inputs], sp, use_tqdm=False, lora_request=lora)[0]
    worker(llm, "flush")  # the save is asynchronous: make it visible to the next step of the test
    return list(out.outputs[0].token_ids), out.kv_transfer_params["kvtier"]["matched_tokens"], out.num_cached_tokens


def corrupt_segments(disk_path: str | Path) -> int:
    """Flip one byte in the middle of every record value in the L3 segment files; returns how many.

    Walks DiskTier's format (``kvtier/tiers/disk.py``): a 64-byte segment header, then records of
    a 24-byte header (magic, hdr crc, flags, key len, value len, data crc, reserved), key, value,
    padding to 8 bytes."""
    rec = struct.Struct("<IIHHIII")
    n = 0
    for seg in sorted(Path(disk_path).glob("seg-*.kvs")):
        with open(seg, "r+b") as f:
            data = f.read()
            off = 64
            while off + rec.size <= len(data):
                magic, _, _, klen, vlen, _, _ = rec.unpack_from(data, off)
                if magic != 0x3152564B:
                    break
                mid = off + rec.size + klen + vlen // 2
                f.seek(mid)
                f.write(bytes([data[mid] ^ 0xFF]))
                n += 1
                off += (rec.size + klen + vlen + 7) & ~7
    return n
