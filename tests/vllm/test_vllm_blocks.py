"""The vLLM connector's engine-free parts: configuration, the worker's block store, the lookup
socket. (The connector on a real engine is tested in tests_vllm/, in the vLLM venv.)"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

from kvtier.vllm import kv_transfer_config
from kvtier.vllm.blocks import BlockShape, BlockStore, connector_config, content_fp, stored_codec
from kvtier.vllm.lookup import LookupClient, LookupServer
from kvtier.store.prefix import chained_block_hashes

SHAPE = BlockShape(num_layers=3, kv_heads=2, block_tokens=32, head_dim=16, dtype=torch.float32)


def staged_blocks(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, SHAPE.kv_heads, 2, SHAPE.block_tokens, SHAPE.head_dim, generator=g)
            for _ in range(SHAPE.num_layers)]  # per layer: [n, kv_heads, 2, block_tokens, head_dim]


def hashes(n: int, start: int = 0) -> list[str]:
    return chained_block_hashes(list(range(start, start + n * SHAPE.block_tokens)), SHAPE.block_tokens, "mtest")


def make_store(tmp_path, codec="raw", **fields) -> BlockStore:
    cfg, codec = connector_config({"codec": codec, "host_bytes": 1 << 20, "disk_segment_bytes": 1 << 20,
                                   "disk_bytes": 8 << 20, **fields}, SHAPE.block_tokens)
    return BlockStore(cfg, codec, SHAPE, "model-a")


def pages_of(n_pages: int) -> torch.Tensor:
    return torch.zeros(n_pages, SHAPE.kv_heads, 2, SHAPE.block_tokens, SHAPE.head_dim)


def test_config_names_bad_fields(tmp_path):
    with pytest.raises(ValueError, match="policy"):
        connector_config({"policy": "lru"}, 128)  # a kvtier-cache field with no meaning under vLLM
    with pytest.raises(ValueError, match="codec must be one of"):
        connector_config({"codec": "int3"}, 128)
    with pytest.raises(ValueError, match="failure_policy"):
        kv_transfer_config(failure_policy="ignore")
    toml = tmp_path / "kvtier.toml"
    toml.write_text('[kvtier]\ncodec = "int8"\ngroup_size = 64\nhost_bytes = 1048576\n')
    cfg, codec = connector_config({"config": str(toml), "host_bytes": 2 << 20}, 128)
    assert (codec, cfg.group_size, cfg.host_bytes, cfg.block_tokens) == ("int8", 64, 2 << 20, 128)


@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_save_lookup_load_round_trip(tmp_path, codec):
    store = make_store(tmp_path, codec, disk_path=str(tmp_path / "l3"))
    try:
        hs, staged = hashes(3), staged_blocks(3)
        store.save(hs, [t.clone() for t in staged])
        assert store.lookup(hs) == 3  # counted while queued, too
        assert store.lookup(hs[:1] + hashes(1, start=999)) == 1
        pages = pages_of(8)
        counts = {"l2": 0, "l3": 0, "l4": 0}
        store.flush_hashes(hs)
        for layer in range(SHAPE.num_layers):
            recs = store.fetch_layer(layer, hs, counts)
            assert store.write_layer(recs, pages, [5, 1, 6]) is None
            got = pages[[5, 1, 6]]
            if codec == "raw":
                assert torch.equal(got, staged[layer])
            else:
                assert (got - staged[layer]).abs().max() < 0.05
        assert counts == {"l2": 9, "l3": 0, "l4": 0}
        assert store.stats()["saved_blocks"] == 3
    finally:
        store.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_raw_is_the_pass_through_codec_of_the_kv_dtype(tmp_path, dtype):
    shape = dataclasses.replace(SHAPE, dtype=dtype)
    cfg, _ = connector_config({"host_bytes": 1 << 20}, SHAPE.block_tokens)
    raw, same = BlockStore(cfg, "raw", shape, "model-a"), BlockStore(cfg, stored_codec("raw", dtype), shape, "model-a")
    try:
        assert raw.fp == same.fp, "raw stores the very records of the pass-through codec"
        hs, staged = hashes(2), [t.to(dtype) for t in staged_blocks(2)]
        raw.save(hs, [t.clone() for t in staged])
        raw.flush_hashes(hs)
        pages = pages_of(2).to(dtype)
        assert raw.write_layer(raw.fetch_layer(0, hs, {"l2": 0, "l3": 0, "l4": 0}), pages, [1, 0]) is None
        assert torch.equal(pages[[1, 0]], staged[0])
    finally:
        raw.close()
        same.close()
    with pytest.raises(ValueError, match="codec 'raw' needs KV dtype"):
        BlockStore(cfg, "raw", dataclasses.replace(SHAPE, dtype=torch.float64), "model-a")


@pytest.mark.parametrize("dtype, other", [(torch.bfloat16, "fp16"), (torch.float16, "bf16")])
def test_the_other_16_bit_codec_is_refused_when_the_connector_is_built(tmp_path, dtype, other):
    """Converting 16-bit KV to the other 16-bit dtype would fail every save (the codec refuses
    it) or lose range/precision at the same bytes: refused at construction, naming the field
    and the codecs allowed for the model; the model's own 16-bit codec and float32 KV work."""
    shape = dataclasses.replace(SHAPE, dtype=dtype)
    cfg, codec = connector_config({"codec": other, "host_bytes": 1 << 20}, SHAPE.block_tokens)
    own = "bf16" if other == "fp16" else "fp16"
    other_dtype = torch.float16 if other == "fp16" else torch.bfloat16
    with pytest.raises(ValueError, match=rf"codec must be one of \('raw', '{own}', 'int8'.*got '{other}'"):
        BlockStore(cfg, codec, shape, "model-a")
    with pytest.raises(ValueError, match="kv_connector_extra_config: codec"):
        content_fp(cfg, codec, shape, "model-a")  # the scheduler side's key seed
    for name, sh in ((own, shape), (other, SHAPE)):  # float32 KV: rounded to 16 bits, as documented
        store = BlockStore(connector_config({"codec": name, "host_bytes": 1 << 20}, SHAPE.block_tokens)[0],
                           name, sh, "model-a")
        try:
            hs, staged = hashes(1), [t.to(sh.dtype) for t in staged_blocks(1)]
            store.save(hs, [t.clone() for t in staged])
            store.flush_hashes(hs)
            pages = pages_of(1).to(sh.dtype)
            assert store.write_layer(store.fetch_layer(0, hs, {"l2": 0, "l3": 0, "l4": 0}), pages, [0]) is None
            want = staged[0] if sh.dtype == dtype else staged[0].to(other_dtype).float()
            assert torch.equal(pages, want) and store.stats()["saved_blocks"] == 1
        finally:
            store.close()


def test_a_restarted_store_finds_l3_and_forgets_corrupt_blocks(tmp_path):
    hs, staged = hashes(2), staged_blocks(2)
    store = make_store(tmp_path, disk_path=str(tmp_path / "l3"))
    store.save(hs, staged)
    store.close()
    store = make_store(tmp_path, disk_path=str(tmp_path / "l3"))
    try:
        assert store.lookup(hs) == 2
        counts = {"l2": 0, "l3": 0, "l4": 0}
        assert None not in store.fetch_layer(1, hs, counts) and counts["l3"] == 2
        store.forget(hs[1:])
        assert store.lookup(hs) == 1
    finally:
        store.close()
    other = make_store(tmp_path, codec="int4", disk_path=str(tmp_path / "l3"))
    try:
        assert other.lookup(hs) == 0, "another codec's keys never match"
    finally:
        other.close()


def test_a_record_of_another_layout_is_a_failed_block(tmp_path):
    store = make_store(tmp_path)
    try:
        assert store.write_layer([b"not a record"], pages_of(2), [0]) == 0
    finally:
        store.close()


def test_lookup_socket(tmp_path):
    path = str(tmp_path / "s.sock")
    server = LookupServer(path, {"lookup": lambda req: {"n": len(req["hashes"]) - 1},
                                 "stats": lambda req: 1 / 0})
    client = LookupClient(path, connect_timeout_s=2.0)
    try:
        assert client.lookup(["a", "b", "c"]) == 2
        assert client.lookup([]) == 0
        with pytest.raises(OSError, match="ZeroDivisionError"):
            client.call({"op": "stats"})
        assert client.lookup(["a", "b"]) == 1, "an error reply leaves the connection usable"
    finally:
        client.close()
        server.close()
    dead = LookupClient(path, connect_timeout_s=0.1)
    assert dead.lookup(["a"]) == 0, "an unreachable worker holds nothing"


@pytest.fixture(params=["redis", "mooncake"])
def l4_server(request):
    """(remote_url, kill) of a fresh L4 server: a redis-server, or a Mooncake master + store server."""
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        return server.url, server.kill
    pool = request.getfixturevalue("mooncake_pool")
    return pool.url, pool.kill_master


def test_another_store_finds_blocks_through_l4(tmp_path, l4_server):
    url, kill = l4_server
    hs, staged = hashes(2), staged_blocks(2)
    writer = make_store(tmp_path, remote_url=url)
    writer.save(hs, [t.clone() for t in staged])
    writer.close()  # writes what is queued
    reader = make_store(tmp_path, remote_url=url)
    try:
        assert reader.lookup(hs) == 2
        counts = {"l2": 0, "l3": 0, "l4": 0}
        pages = pages_of(2)
        assert reader.write_layer(reader.fetch_layer(2, hs, counts), pages, [1, 0]) is None
        assert counts["l4"] == 2 and torch.equal(pages[[1, 0]], staged[2])
        kill()
        assert reader.lookup(hs) == 0, "a dead server holds nothing"
    finally:
        reader.close()



def test_the_connector_encodes_with_the_caches_codecs(tmp_path):
    """A block saved through vLLM is encoded as TieredCache encodes it for the same config
    (int8's zero points, its values' axis): what loads equals that codec's round trip."""
    from kvtier.compress import get_codec

    store = make_store(tmp_path, "int8")
    try:
        hs, staged = hashes(2), staged_blocks(2)
        store.save(hs, [t.clone() for t in staged])
        store.flush_hashes(hs)
        kw = {role: store.cfg.codec_kwargs("int8", role) for role in ("key", "value")}
        assert kw["key"].get("zero_point") and kw["value"]["axis"] == "channel"  # the defaults
        pages = pages_of(4)
        for layer in range(SHAPE.num_layers):
            recs = store.fetch_layer(layer, hs, {"l2": 0, "l3": 0, "l4": 0})
            assert store.write_layer(recs, pages, [3, 0]) is None
            for role, i in (("key", 0), ("value", 1)):
                codec = get_codec("int8", **kw[role])
                for j, page in enumerate((3, 0)):
                    x = staged[layer][j, :, i]  # [kv_heads, block_tokens, head_dim]
                    assert torch.equal(pages[page, :, i], codec.decode(codec.encode(x)))
    finally:
        store.close()


# ---- identity: the engine's weights, the codecs, the request's inputs -------------------------

def write_checkpoint(path, tensors: dict, shards: int = 1) -> str:
    """A safetensors checkpoint directory (``shards`` files and an index when more than one)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return str(path)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(path)


def small_weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(64, 16, generator=g),
            "layers.0.mlp.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
            "layers.1.mlp.weight": torch.randn(32, 16, generator=g),
            "norm.weight": torch.ones(16, dtype=torch.float16)}


def test_checkpoint_digest_sees_one_changed_element_and_not_the_path_or_sharding(tmp_path):
    from kvtier.vllm.identity import checkpoint_digest

    w = small_weights()
    base = checkpoint_digest(write_checkpoint(tmp_path / "base", w))
    assert checkpoint_digest(write_checkpoint(tmp_path / "copy", w)) == base  # another path
    assert checkpoint_digest(write_checkpoint(tmp_path / "sharded", w, shards=3)) == base
    assert checkpoint_digest(tmp_path / "base" / "model.safetensors") == base
    for name in w:  # one element of any tensor, however small the change
        t = w[name].clone()
        t.reshape(-1).view(torch.uint8)[t.numel() // 2 * t.element_size()] ^= 1  # its lowest bit
        assert checkpoint_digest(write_checkpoint(tmp_path / f"tuned-{name}", {**w, name: t})) != base, name
    other = dict(w, **{"norm.weight": w["norm.weight"].float()})  # same values, another dtype
    assert checkpoint_digest(write_checkpoint(tmp_path / "dtype", other)) != base


def test_checkpoint_digest_refuses_what_it_cannot_read(tmp_path):
    from kvtier.vllm.identity import NoIdentity, checkpoint_digest

    (tmp_path / "bin").mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(NoIdentity, match="no safetensors"):
        checkpoint_digest(tmp_path / "bin")  # a pickle is never read
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(NoIdentity, match="not a safetensors"):
        checkpoint_digest(tmp_path / "bad")
    write_checkpoint(tmp_path / "shards", small_weights(), shards=2)
    os.remove(tmp_path / "shards" / "model-00002-of-00002.safetensors")
    with pytest.raises(NoIdentity, match="shard missing"):
        checkpoint_digest(tmp_path / "shards")
    with pytest.raises(NoIdentity, match="not a local"):
        checkpoint_digest(tmp_path / "nowhere")


def write_gguf(path, tensors: dict) -> str:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for name, t in tensors.items():
        w.add_tensor(name, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_checkpoint_digest_of_a_gguf_file(tmp_path):
    from kvtier.vllm.identity import checkpoint_digest

    w = {"a.weight": torch.randn(8, 16), "b.weight": torch.randn(4, 16).half()}
    base = checkpoint_digest(write_gguf(tmp_path / "a.gguf", w))
    assert checkpoint_digest(write_gguf(tmp_path / "copy.gguf", w)) == base
    tuned = dict(w, **{"b.weight": w["b.weight"].clone()})
    tuned["b.weight"][3, 15] += 1
    assert checkpoint_digest(write_gguf(tmp_path / "tuned.gguf", tuned)) != base


def test_engine_identity_names_weights_config_and_quantization(tmp_path):
    from kvtier.vllm.identity import NoIdentity, engine_identity

    d = write_checkpoint(tmp_path / "m", small_weights())
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rope_theta": 1e4,
           "_name_or_path": d}
    base = engine_identity(d, None, "auto", cfg, None)
    assert engine_identity(d, None, "safetensors", dict(cfg, _name_or_path="elsewhere"), None) == base
    assert engine_identity(d, None, "auto", dict(cfg, rope_theta=1e5), None) != base
    assert engine_identity(d, None, "auto", cfg, "fp8") != base
    tuned = write_checkpoint(tmp_path / "t", small_weights(seed=1))
    assert engine_identity(tuned, None, "auto", cfg, None) != base
    with pytest.raises(NoIdentity, match="load_format"):
        engine_identity(d, None, "dummy", cfg, None)  # random weights: nothing to name
    with pytest.raises(NoIdentity, match="revision"):
        engine_identity("org/model", None, "auto", cfg, None)  # not in the local cache either
    with pytest.raises(NoIdentity, match="revision"):
        engine_identity("org/model", "main", "auto", cfg, None)
    a = engine_identity("org/model", "a" * 40, "auto", cfg, None)
    assert a != engine_identity("org/model", "b" * 40, "auto", cfg, None)


def test_engine_identity_of_a_hub_id_is_the_commit_its_cached_snapshot_holds(tmp_path, monkeypatch):
    from kvtier.vllm.identity import NoIdentity, engine_identity

    # the layout huggingface_hub writes: refs/<branch> names the commit, snapshots/<commit>/ the files
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--model"
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}

    def cache(commit):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")

    with pytest.raises(NoIdentity, match="cache"):
        engine_identity("org/model", None, "auto", cfg, None)  # not downloaded
    cache("c" * 40)
    first = engine_identity("org/model", None, "auto", cfg, None)
    assert first == engine_identity("org/model", "c" * 40, "auto", cfg, None)
    cache("d" * 40)  # main moved to a new commit: other weights
    assert engine_identity("org/model", None, "auto", cfg, None) != first


def test_adapter_digest_names_its_weights_and_config(tmp_path):
    from kvtier.vllm.identity import NoIdentity, adapter_digest

    def adapter(name, seed=0, r=4):
        p = tmp_path / name
        write_checkpoint(p, {"a.lora_A.weight": torch.randn(r, 8, generator=torch.Generator().manual_seed(seed))})
        (p / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": 8, "base_model_name_or_path": name}))
        return p

    base = adapter_digest(adapter("x"))
    assert adapter_digest(adapter("x-copy")) == base  # where it was trained from is not named
    assert adapter_digest(adapter("y", seed=1)) != base
    p = adapter("z")
    (p / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 16}))
    assert adapter_digest(p) != base
    with pytest.raises(NoIdentity, match="adapter_config"):
        adapter_digest(tmp_path / "none")


def test_request_keys_fold_salt_adapter_and_vllms_block_hash():
    from kvtier.vllm.identity import fold_block_hashes, request_salt

    assert request_salt(None, None) == request_salt("", None) == ""  # plain requests share one chain
    salts = {request_salt("a", None), request_salt("b", None), request_salt(None, ("x", "/p", "d1")),
             request_salt(None, ("x", "/p", "d2")), request_salt("a", ("x", "/p", "d1")), ""}
    assert len(salts) == 6
    fp = content_fp(*connector_config({"codec": "raw"}, SHAPE.block_tokens), SHAPE, "model-a")
    toks = list(range(3 * SHAPE.block_tokens))
    chains = {s: chained_block_hashes(toks, SHAPE.block_tokens, fp, salt=s) for s in salts}
    assert len({c[0] for c in chains.values()}) == 6  # every salt its own chain from block 0
    v1, v2 = [b"\x01" * 32] * 3, [b"\x01" * 32, b"\x02" * 32, b"\x01" * 32]
    folded = fold_block_hashes(chains[""], v1)
    assert folded == fold_block_hashes(chains[""], list(v1))  # deterministic
    other = fold_block_hashes(chains[""], v2)  # vLLM saw another image/embedding/adapter in block 1
    assert other[0] == folded[0] and other[1] != folded[1]
    assert len(set(folded) | set(fold_block_hashes(chains[request_salt("a", None)], v1))) == 6
    with pytest.raises(ValueError, match="one entry per block"):
        fold_block_hashes(chains[""], v1[:2])


def test_content_fp_names_every_codec_parameter_and_the_namespace():
    from kvtier.config import KVTierConfig

    def fp(codec="int8", **fields):
        cfg = KVTierConfig.from_dict(dict(block_tokens=SHAPE.block_tokens, device_tokens=SHAPE.block_tokens,
                                          codec=codec, **fields))
        return content_fp(cfg, codec, SHAPE, "model-a")

    base = fp()
    assert fp() == base
    assert fp(int8_zero_point="none") != base  # int8 without zero points: other records
    assert fp(int8_value_axis="token") != base
    assert fp(namespace="tenant-1") != base
    assert fp("int2", int2_key_outliers=2) != fp("int2", int2_key_outliers=0)
    assert content_fp(connector_config({"codec": "int8", "namespace": "n"}, SHAPE.block_tokens)[0], "int8",
                      SHAPE, "model-a") == fp(namespace="n")


def test_per_role_codecs_and_key_transform(tmp_path):
    """K4V2 with rotated keys: fields of the connector, in the blocks' identity, and each role at
    its codec's error through save and load."""
    fields = dict(value_codec="int2", key_transform="hadamard")
    cfg, codec = connector_config({"codec": "int4", **fields}, SHAPE.block_tokens)
    assert (codec, cfg.value_codec, cfg.key_transform) == ("int4", "int2", "hadamard")
    fps = {content_fp(connector_config({"codec": "int4", **f}, SHAPE.block_tokens)[0], "int4", SHAPE, "model-a")
           for f in ({}, {"value_codec": "int2"}, fields, {"key_codec": "int8"})}
    assert len(fps) == 4
    with pytest.raises(ValueError, match="key_codec must be unset with codec 'raw'"):
        connector_config({"codec": "raw", "key_codec": "int4"}, SHAPE.block_tokens)
    with pytest.raises(ValueError, match="value_codec must be one of"):
        connector_config({"codec": "int4", "value_codec": "int3"}, SHAPE.block_tokens)
    store = make_store(tmp_path, "int4", **fields)
    try:
        hs, staged = hashes(2), staged_blocks(2, seed=3)
        store.save(hs, [t.clone() for t in staged])
        store.flush_hashes(hs)
        pages = pages_of(4)
        recs = store.fetch_layer(0, hs, {"l2": 0, "l3": 0, "l4": 0})
        assert store.write_layer(recs, pages, [2, 0]) is None
        got, want = pages[[2, 0]], staged[0]  # [n, kv_heads, 2, block_tokens, head_dim]
        rel = [((got[:, :, r] - want[:, :, r]).norm() / want[:, :, r].norm()).item() for r in (0, 1)]
        assert rel[0] < 0.15 and 0.25 < rel[1] < 0.5  # int4 keys, int2 values
    finally:
        store.close()
