"""int8 and int4 records on a real engine: how often the tokens generated over a quantized
prefix agree with the cold (exact) run of the same engine, over several prompts.

Greedy decoding diverges for good at the first differing token, so agreement is reported as the
fraction of generated tokens before the first difference, averaged over the prompts.
"""
from __future__ import annotations

import pytest

from .helpers import engine, run, worker

BLOCK = 128
N_PROMPTS = 4
# Measured here (4 prompts x 16 tokens, float32 KV): int8 1.00 (every token of every prompt),
# int4 0.28 (0.19, 0.25, 0.62, 0.06: greedy decoding drifts within a few tokens over a 4-bit
# prefix of this 135M model). The floors catch a broken codec (which agrees ~0), not drift.
FLOORS = {"int8": 0.75, "int4": 0.1, "k4v2": 0.05}
# Stored bytes per value: codes + a scale and a zero per 32-value group (int8 keys and values
# have zero points by default, as in TieredCache), in the KV dtype (float32 here): int8
# (32 + 8) / 32, int4 (16 + 8) / 32; record headers aside.
# k4v2: int4 keys (rotated: the same bytes) and int2 values, (8 + 8) / 32.
BYTES_PER_VALUE = {"int8": 40 / 32, "int4": 24 / 32, "k4v2": (24 / 32 + 16 / 32) / 2}
# connector fields of each case beyond its codec
FIELDS = {"k4v2": dict(codec="int4", value_codec="int2", key_transform="hadamard")}


def agreement(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), len(b))


@pytest.mark.parametrize("codec", ["int8", "int4", "k4v2"])
def test_quantized_prefix_agrees_with_the_exact_run(codec, model_dir, token_ids, capsys):
    prompts = [token_ids[5000 + 700 * i: 5000 + 700 * i + 4 * BLOCK + 60] for i in range(N_PROMPTS)]
    scores = []
    with engine(model_dir, **FIELDS.get(codec, {"codec": codec})) as llm:
        for p in prompts:
            cold, _, _ = run(llm, p, load=False, save=False)
            run(llm, p)  # stores the prompt's 4 full blocks
            warm, matched, _ = run(llm, p)
            assert matched == 4 * BLOCK
            scores.append(agreement(warm, cold))
        stats = worker(llm, "stats")
    mean = sum(scores) / len(scores)
    with capsys.disabled():
        print(f"\n[kvtier-vllm] {codec}: agreement with the exact run {mean:.2f} over {len(scores)} prompts "
              f"({', '.join(f'{s:.2f}' for s in scores)}); {stats['bytes_per_token']:.0f} B/token stored")
    assert stats["load_failures"] == 0 and stats["loaded_blocks"] == 4 * N_PROMPTS
    values = 30 * 2 * 3 * 64  # K and V values per token: 30 layers, 3 kv heads, head_dim 64
    assert stats["bytes_per_token"] == pytest.approx(values * BYTES_PER_VALUE[codec], rel=0.02)
    assert mean >= FLOORS[codec], scores
