"""kvtier.attach over a Mooncake Store L4 on the real model (bf16, lossless ``bf16`` codec): another
process reuses a prefix through the pool with identical logits; a value damaged in the pool is
caught by its CRC and recomputed; a master killed mid-generation changes nothing in the output,
warns once, and publishing resumes after it restarts."""
import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import torch

from kvtier.hf.cache import TieredCache, attach
from kvtier.tiers.mooncake import MooncakeTier

from tests.mooncake_server import raw_client
from test_prefix import PREFIX, SUFFIX, cfg, prompts, two_stage_logits  # this directory is not a package

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[2])
    from kvtier.config import KVTierConfig
    from kvtier.hf.cache import TieredCache, attach
    from kvtier.models import load_model
    model, _ = load_model(dtype=torch.bfloat16)
    for i, a in enumerate(json.loads(sys.argv[1])):
        if i:
            sys.stdin.readline()  # the parent damages a record in between
        cache = attach(model, KVTierConfig(**a["cfg"]))
        ids = torch.tensor(a["ids"])
        n = cache.load_prefix(ids)
        with torch.no_grad():
            logits = model(input_ids=ids[:, n:], cache=cache).logits[0].float()
        np.save(a["out"], logits.numpy(), allow_pickle=False)
        s = cache.stats()
        print(json.dumps({"n": n, "l4_hits": s["remote"]["hits"], "corrupt": s["remote"]["tier"]["corrupt"]}),
              flush=True)
        cache.close()  # its store with it: the next run starts with nothing local, all from the pool
""")


@torch.no_grad()
def cropped_prefix_logits(model, ids, n):
    """The reference for a prefix cut short at ``n``: its KV as the publisher computed it (the
    whole prefix in one chunk, bf16 rounds by chunk length), kept up to ``n``, then the rest."""
    ref = TieredCache(cfg(), model)
    model(input_ids=ids[:, :PREFIX], cache=ref)
    ref.crop(n - PREFIX)
    out = model(input_ids=ids[:, n:], cache=ref).logits[0].float()  # [T - n, vocab]
    ref.close()
    return out


def _result_line(proc) -> dict:
    """The child's next result (a JSON line; the model loader may print other lines first)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            proc.stderr.seek(0)
            raise AssertionError(proc.stderr.read()[-3000:])
        if line.startswith('{"n"'):
            return json.loads(line)


def raw_get(pool, key: str) -> bytes:
    raw = raw_client(pool)
    try:
        return raw.get(key)
    finally:
        raw.close()


def raw_put(pool, key: str, value: bytes) -> None:
    raw = raw_client(pool)
    try:
        assert raw.upsert(key, value) == 0
    finally:
        raw.close()


def _publish(model, ids, url):
    first = attach(model, cfg(remote_url=url))
    with torch.no_grad():  # the shared prefix (a system prompt) is prefilled as its own chunk
        model(input_ids=ids[:, :PREFIX], cache=first)
        model(input_ids=ids[:, PREFIX:], cache=first)
    first.store.flush()  # write-through to L4 done
    published = first.stats()["remote"]["published_blocks"]
    return first, published


def test_second_process_reuses_prefix_through_the_pool_and_a_damaged_block_is_recomputed(
        model_bf16, tokenizer, tmp_path, mooncake_shared):
    url = mooncake_shared.url_with()
    a_ids, b_ids = prompts(tokenizer)
    first, published = _publish(model_bf16, a_ids, url)
    assert published >= PREFIX // 32 * 30
    # damage layer 5 of the prefix's 4th block in the pool (one payload bit, as a torn write)
    _, hashes = first.store.content.prefix_hashes(a_ids[0, :PREFIX].tolist())
    key = cfg().remote_key_prefix + first.store.content.key(5, hashes[3])
    first.close()  # the last cache of its store: the store closes too

    runs = [{"cfg": cfg(remote_url=url).to_dict(), "ids": b_ids.tolist(), "out": str(tmp_path / "whole.npy")},
            {"cfg": cfg(remote_url=url).to_dict(), "ids": b_ids.tolist(), "out": str(tmp_path / "damaged.npy")}]
    err = open(tmp_path / "child.err", "w+")  # a file: the client's own logging would fill a pipe
    r = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(runs), ROOT], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    r.stderr = err
    try:
        whole = _result_line(r)
        framed = bytearray(raw_get(mooncake_shared, key))
        framed[-5] ^= 0x10
        raw_put(mooncake_shared, key, bytes(framed))
        r.stdin.write("go\n")
        r.stdin.flush()
        damaged = _result_line(r)
        assert r.wait(timeout=120) == 0, (tmp_path / "child.err").read_text()[-3000:]
    finally:
        if r.poll() is None:
            r.kill()
        r.communicate()
        err.close()
    # another process: the whole prefix came from the pool, logits identical to computing it here
    assert whole["n"] == PREFIX and whole["l4_hits"] >= PREFIX // 32 * 30 and whole["corrupt"] == 0
    assert torch.equal(torch.from_numpy(np.load(runs[0]["out"])), two_stage_logits(model_bf16, b_ids, PREFIX))
    # the damaged block failed its CRC: the prefix stops before it and the rest is computed
    assert damaged["corrupt"] >= 1 and damaged["n"] == 3 * 32
    assert torch.equal(torch.from_numpy(np.load(runs[1]["out"])), cropped_prefix_logits(model_bf16, b_ids, 3 * 32))


def test_master_killed_mid_generation_same_tokens_one_warning_then_served_again(
        model_bf16, tokenizer, mooncake_pool, caplog):
    a_ids, b_ids = prompts(tokenizer)
    a_ids = a_ids[:, :-4]  # 4 tokens short of a block: the 4th decode step seals one and publishes it
    ref_cache = attach(model_bf16, cfg())
    ref = model_bf16.generate(a_ids, cache=ref_cache, max_new_tokens=8, do_sample=False)
    ref_cache.close()

    cache = attach(model_bf16, cfg(remote_url=mooncake_pool.url))
    cache.store.offload.l4.retry_interval_s = 0.0  # probe on every call: recovery is seen at once
    steps = []

    def kill_after_prefill(module, args, kwargs):
        steps.append(1)
        if len(steps) == 2:
            mooncake_pool.kill_master()

    h = model_bf16.register_forward_pre_hook(kill_after_prefill, with_kwargs=True)
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.mooncake"):
            out = model_bf16.generate(a_ids, cache=cache, max_new_tokens=8, do_sample=False)
            cache.store.flush()
    finally:
        h.remove()
    assert torch.equal(out, ref)
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) == 1, [r.getMessage() for r in caplog.records]
    s = cache.stats()["remote"]
    assert s["tier"]["connected"] is False
    assert s["tier"]["rejected"] > 0, s  # the block sealed after the kill was not published
    cache.close()

    mooncake_pool.restart_master()  # empty: a restarted master remembers nothing
    again = attach(model_bf16, cfg(remote_url=mooncake_pool.url))
    with torch.no_grad():
        model_bf16(input_ids=b_ids, cache=again)
    again.store.flush()
    s2 = again.stats()["remote"]
    sealed = (PREFIX + SUFFIX) // 32 - 1  # the last block of b is still open
    assert s2["tier"]["connected"] is True and s2["published_blocks"] == sealed * 30
    assert s2["tier"]["rejected"] == 0
    listed = MooncakeTier(mooncake_pool.url, key_prefix=cfg().remote_key_prefix)
    assert len(listed) == sealed * 30  # b's blocks are in the pool again
    listed.close()
    again.close()
