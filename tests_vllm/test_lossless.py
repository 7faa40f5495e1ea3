"""The raw (lossless) codec on a real engine: a prefix stored by an earlier request, by an engine
that was shut down (L3), and by another engine (L4, Redis) gives exactly the cold run's tokens,
and corrupt or unreachable blocks fall back to recomputation with one warning.

```
 engine A  disk=L3, redis   cold references (kvtier off), then stores P1, P2, P3; P1' hits L2
 engine B  disk=L3          restart: P1' hits L3; L3 corrupted: P2 recomputed, one warning
 engine C  redis            P1' hits L4; redis killed: P3 computed, one warning
```
P1 and P1' share their first 4 blocks (512 tokens) and differ after them.
"""
from __future__ import annotations

import pytest

from .helpers import corrupt_segments, engine, run, worker

BLOCK = 128
PREFIX = 4 * BLOCK


@pytest.fixture(scope="module")
def prompts(token_ids) -> dict[str, list[int]]:
    prefix = token_ids[:PREFIX]
    return {"P1": prefix + token_ids[PREFIX:PREFIX + 90],
            "P1'": prefix + token_ids[1500:1600],
            "P2": token_ids[2000:2600],
            "P3": token_ids[3000:3600]}


@pytest.fixture(scope="module")
def stored(model_dir, prompts, redis_module, tmp_path_factory):
    """Engine A: the cold tokens of every prompt, then each prompt stored in L2, L3 and L4."""
    disk = str(tmp_path_factory.mktemp("l3") / "kvtier")
    out = {"disk": disk, "redis": redis_module}
    with engine(model_dir, codec="raw", disk_path=disk, remote_url=redis_module.url) as llm:
        out["cold"] = {name: run(llm, p, load=False, save=False) for name, p in prompts.items()}
        out["first"] = run(llm, prompts["P1"])
        out["warm"] = run(llm, prompts["P1'"])
        for name in ("P2", "P3"):
            run(llm, prompts[name])
        out["stats"] = worker(llm, "stats")
    return out


def test_cold_runs_match_nothing(stored):
    for name, (_, matched, cached) in stored["cold"].items():
        assert (matched, cached) == (0, 0), name
    assert stored["first"][1] == 0, "nothing was stored before P1"
    assert stored["first"][0] == stored["cold"]["P1"][0], "a storing run must not change the output"


def test_prefix_stored_by_an_earlier_request(stored):
    tokens, matched, cached = stored["warm"]
    assert matched == PREFIX and cached == PREFIX, "P1' must load the 4 blocks P1 stored"
    assert tokens == stored["cold"]["P1'"][0]
    s = stored["stats"]
    assert s["l2_hits"] == 4 * 30 and s["l3_hits"] == 0 and s["l4_hits"] == 0, s  # 4 blocks x 30 layers
    # P1 (602 tokens + 16 generated: 4 full blocks), P1' (all 4 of its full blocks loaded, none new),
    # P2 and P3 (4 each)
    assert s["saved_blocks"] == 4 + 0 + 4 + 4, s
    assert s["bytes_per_token"] == pytest.approx(30 * 2 * 3 * 64 * 4, rel=0.01), s  # float32 K+V, 30 layers


def test_prefix_stored_by_an_engine_that_was_shut_down(stored, model_dir, prompts, capfd):
    with engine(model_dir, codec="raw", disk_path=stored["disk"]) as llm:
        tokens, matched, _ = run(llm, prompts["P1'"])
        assert matched == PREFIX and tokens == stored["cold"]["P1'"][0]
        assert worker(llm, "stats")["l3_hits"] == 4 * 30

        capfd.readouterr()
        assert corrupt_segments(stored["disk"]) > 0
        tokens, matched, _ = run(llm, prompts["P2"])
        err = capfd.readouterr().err
        assert tokens == stored["cold"]["P2"][0], "a corrupt block must be recomputed, not used"
        assert matched == PREFIX, "the lookup still found P2's index entries"
        assert err.count("could not be loaded") == 1, err[-3000:]
        assert worker(llm, "stats")["load_failures"] == 1

        # The failing block was forgotten: the next request recomputes and stores P2 again ...
        tokens, matched, _ = run(llm, prompts["P2"])
        assert matched == 0 and tokens == stored["cold"]["P2"][0]
        # ... and the one after it loads the fresh copy.
        tokens, matched, _ = run(llm, prompts["P2"])
        assert matched == PREFIX and tokens == stored["cold"]["P2"][0]
        assert "could not be loaded" not in capfd.readouterr().err


def test_prefix_stored_by_another_engine_through_redis(stored, model_dir, prompts, capfd):
    redis = stored["redis"]
    with engine(model_dir, prefix_caching=True, codec="raw", remote_url=redis.url) as llm:
        tokens, matched, _ = run(llm, prompts["P1'"])
        assert matched == PREFIX and tokens == stored["cold"]["P1'"][0]
        assert worker(llm, "stats")["l4_hits"] == 4 * 30

        capfd.readouterr()
        redis.kill()
        tokens, matched, _ = run(llm, prompts["P3"])
        err = capfd.readouterr().err
        assert matched == 0, "an unreachable L4 is a miss"
        assert tokens == stored["cold"]["P3"][0]
        assert err.count("unreachable") == 1, err[-3000:]
