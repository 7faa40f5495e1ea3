"""Two engines sharing blocks through one Mooncake Store (a master and a store server on loopback,
``tests/mooncake_server.py``), raw (lossless) codec: what engine A stored, engine B loads from
the pool with exactly the cold run's tokens; a master killed under B is a miss with one warning.

```
 engine A  mooncake   cold references (kvtier off), then stores P1, P3; shut down
 engine B  mooncake   P1' hits L4 (A's blocks, held by the store server); master killed: P3
                      computed, one warning
```
"""
from __future__ import annotations

import pytest

from tests.conftest import serve_mooncake

from .helpers import engine, run, worker

BLOCK = 128
PREFIX = 4 * BLOCK


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    yield from serve_mooncake(tmp_path_factory, segment_bytes=256 << 20)


@pytest.fixture(scope="module")
def prompts(token_ids) -> dict[str, list[int]]:
    prefix = token_ids[:PREFIX]
    return {"P1": prefix + token_ids[PREFIX:PREFIX + 90],
            "P1'": prefix + token_ids[1500:1600],
            "P3": token_ids[3000:3600]}


def test_two_engines_share_blocks_through_one_master(model_dir, prompts, pool, capfd):
    url = pool.url_with(buffer_bytes=64 << 20)
    with engine(model_dir, codec="raw", remote_url=url) as llm:
        cold = {name: run(llm, p, load=False, save=False)[0] for name, p in prompts.items()}
        tokens, matched, _ = run(llm, prompts["P1"])
        assert matched == 0 and tokens == cold["P1"]
        assert worker(llm, "stats")["saved_blocks"] == 4

    with engine(model_dir, prefix_caching=True, codec="raw", remote_url=url) as llm:
        tokens, matched, _ = run(llm, prompts["P1'"])
        assert matched == PREFIX and tokens == cold["P1'"]
        assert worker(llm, "stats")["l4_hits"] == 4 * 30  # 4 blocks x 30 layers, all from the pool

        capfd.readouterr()
        pool.kill_master()
        tokens, matched, _ = run(llm, prompts["P3"])
        err = capfd.readouterr().err
        assert matched == 0, "an unreachable master is a miss"
        assert tokens == cold["P3"]
        assert sum("MooncakeTier" in line and "unreachable" in line for line in err.splitlines()) == 1, err[-3000:]
