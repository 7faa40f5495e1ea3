"""KVTierConfig.preset: every named preset builds, runs a short generate on the real model with its
blocks below L1 in the preset's codec, and takes overrides field by field; the demo's kvtier row
is the long-context preset at the demo's sizes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvtier
from kvtier import KVTierConfig
from tests.baselines import make_baseline
from kvtier.models import text_ids
from kvtier.presets import PRESETS, PRESET_NAMES


def _greedy(model, ids, cache, new: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(ids, cache=cache, max_new_tokens=new, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_runs_a_generate_with_its_codec_below_l1(name, model, tokenizer, tmp_path):
    # L1 of 64 tokens under a 256-token prompt: most blocks leave L1 in the preset's codec
    cfg = KVTierConfig.preset(name, device_tokens=64, host_bytes=1 << 20, disk_path=str(tmp_path / "l3"))
    for field, value in PRESETS[name][0].items():
        assert getattr(cfg, field) == value
    ids = text_ids(tokenizer, 256)
    with kvtier.attach(model, cfg) as cache:
        out = _greedy(model, ids, cache, 4)
        st = cache.stats()
    assert out.numel() == 4
    assert st["compression"]["host_codec"] == cfg.codec
    assert st["blocks"]["l2"] + st["blocks"].get("l3", 0) > 0  # the tiers below L1 were used


def test_lossless_gives_dynamic_caches_tokens(model, tokenizer, tmp_path):
    ids = text_ids(tokenizer, 256)
    want = _greedy(model, ids, make_baseline("dynamic", model), 8)
    cfg = KVTierConfig.preset("lossless", device_tokens=64, host_bytes=1 << 20, disk_path=str(tmp_path / "l3"))
    with kvtier.attach(model, cfg) as cache:
        assert torch.equal(_greedy(model, ids, cache, 8), want)


def test_overrides_win_and_lossless_follows_a_16_bit_dtype():
    cfg = KVTierConfig.preset("long-context", codec="int8", device_tokens=1024)
    assert (cfg.attention, cfg.codec, cfg.device_tokens, cfg.block_tokens) == ("sparse", "int8", 1024, 16)
    assert KVTierConfig.preset("lossless").codec == "fp32"  # exact for any KV dtype
    assert KVTierConfig.preset("lossless", dtype="bfloat16").codec == "bf16"
    assert KVTierConfig.preset("lossless", dtype="float16").codec == "fp16"
    with pytest.raises(ValueError, match="preset must be one of long-context, offload, lossless, serve"):
        KVTierConfig.preset("fast")
    with pytest.raises(ValueError, match="codec"):
        KVTierConfig.preset("serve", codec="zip")  # overrides are checked like any field


def test_the_demo_row_is_the_long_context_preset_at_the_demos_sizes():
    from kvtier.eval.caches import kvtier_config
    from kvtier.commands.eval import DEMO
    from kvtier.eval.sweep import demo_configs

    qwen = SimpleNamespace(num_hidden_layers=24, num_key_value_heads=2, head_dim=64, hidden_size=896,
                           num_attention_heads=14)
    ctx = DEMO["contexts"][0]
    (row,) = [s for s in demo_configs() if s.kind == "kvtier"]
    demo = kvtier_config(row, ctx, qwen, disk_path="/l3")
    # the demo's sizes: L1 = 3% of the context in whole 16-token blocks, L2 = 2% of its 16-bit KV
    hot = int(0.03 * ctx) // 16 * 16
    host = int(0.02 * ctx * 2 * 24 * 2 * 64 * 2)
    mine = KVTierConfig.preset("long-context", device_tokens=hot, budget_tokens=hot, host_bytes=host,
                               disk_path="/l3", write_through=False)
    assert mine.to_dict(resolved=True) == demo.to_dict(resolved=True)
