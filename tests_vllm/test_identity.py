"""A stored block is served only to the computation that made it, on a real engine: requests of
other tenants (``cache_salt``), other LoRA adapters, or an engine of other weights (a fine-tuned
copy of the model) reuse none of it; the same tenant, adapter or weights reuse all of it.

```
 engine 1  base, enable_lora, L3 dir   prompt P: salt A, salt B, no salt, adapter X, adapter Y
                                       (each first stores, then hits only itself)
 engine 2  fine-tuned copy, same L3    P: 0 tokens (one MLP weight of one layer x1.01)
 engine 3  base copied to another dir  P: all 4 blocks from L3 (positive control)
```
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from .helpers import engine, run, worker

BLOCK = 128
PREFIX = 4 * BLOCK
RANK = 8
WEIGHTS = "model.safetensors"
PERTURBED = "model.layers.7.mlp.down_proj.weight"


def _copy_model(src: str, dst, perturb: bool) -> str:
    """``src`` at another path: config and tokenizer copied, weights hard-linked (the same
    bytes), or rewritten with :data:`PERTURBED` scaled by 1.01 (the same config and shapes)."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != WEIGHTS:
            shutil.copy(os.path.join(src, name), dst)
    if not perturb:
        os.link(os.path.join(src, WEIGHTS), os.path.join(dst, WEIGHTS))
        return str(dst)
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(src, WEIGHTS))
    tensors[PERTURBED] = tensors[PERTURBED] * 1.01
    save_file(tensors, os.path.join(dst, WEIGHTS), metadata={"format": "pt"})
    return str(dst)


def _adapter(path, seed: int) -> str:
    """A PEFT-format LoRA adapter (rank 8 on q_proj and v_proj of every layer) with random weights."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(30):
        for module, out in (("q_proj", 9 * 64), ("v_proj", 3 * 64)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, 576, generator=g) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.02
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
              "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
              "fan_in_fan_out": False, "modules_to_save": None, "use_dora": False, "use_rslora": False}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


@pytest.fixture(scope="module")
def runs(model_dir, token_ids, tmp_path_factory):
    from vllm.lora.request import LoRARequest

    root = tmp_path_factory.mktemp("identity")
    disk = str(root / "l3")
    prompt = token_ids[9000:9000 + PREFIX + 70]
    lora_x = LoRARequest("x", 1, _adapter(root / "lora-x", 1))
    lora_y = LoRARequest("y", 2, _adapter(root / "lora-y", 2))
    out = {}
    lora_args = {"enable_lora": True, "max_lora_rank": RANK, "max_loras": 2}
    with engine(model_dir, codec="raw", disk_path=disk, engine_args=lora_args) as llm:
        out["cold"] = run(llm, prompt, load=False, save=False)
        for name, kw in (("salt-a", {"cache_salt": "tenant-a"}), ("salt-b", {"cache_salt": "tenant-b"}),
                         ("plain", {}), ("lora-x", {"lora": lora_x}), ("lora-y", {"lora": lora_y})):
            out[name] = [run(llm, prompt, **kw)[1] for _ in range(2)]  # first stores, second must hit
        out["stats-1"] = worker(llm, "stats")
    tuned = _copy_model(model_dir, root / "tuned", perturb=True)
    with engine(tuned, codec="raw", disk_path=disk) as llm:
        out["tuned"] = run(llm, prompt, save=False)
        out["stats-2"] = worker(llm, "stats")
    same = _copy_model(model_dir, root / "same", perturb=False)
    with engine(same, codec="raw", disk_path=disk) as llm:
        out["same"] = run(llm, prompt, save=False)
        out["stats-3"] = worker(llm, "stats")
    return out


def test_cache_salt_separates_tenants(runs):
    # each tenant (and the request without a salt) finds only what it stored itself
    assert runs["salt-a"] == [0, PREFIX]
    assert runs["salt-b"] == [0, PREFIX], "tenant-b must not be served tenant-a's blocks"
    assert runs["plain"] == [0, PREFIX], "a request without a salt must not be served a salted one's blocks"


def test_lora_adapters_are_keyed(runs):
    assert runs["lora-x"] == [0, PREFIX], "adapter x must not be served the base model's blocks"
    assert runs["lora-y"] == [0, PREFIX], "adapter y must not be served adapter x's blocks"
    s = runs["stats-1"]
    assert s["shared"] and s["saved_blocks"] == 5 * 4 and s["load_failures"] == 0, s


def test_fine_tune_reuses_nothing_of_its_base(runs):
    tokens, matched, _ = runs["tuned"]
    assert matched == 0, "a fine-tuned copy must not be served its base model's blocks"
    assert runs["stats-2"]["shared"] and runs["stats-2"]["l3_hits"] == 0
    # positive control: the same weights under another path reuse every stored block from L3
    tokens, matched, _ = runs["same"]
    assert matched == PREFIX and tokens == runs["cold"][0]
    assert runs["stats-3"]["l3_hits"] == 4 * 30
