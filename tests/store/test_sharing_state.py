"""Hypothesis state machine for prefix sharing: sequences with token ids drawn so that prefixes
often coincide, attached prefixes, drops with and without keep_prefix, tiny L1/L2 so blocks keep
moving to L3 — every read checked against the K/V the "model" computes for those ids, and the
reference counts checked against the tables."""
import random
import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from .conftest import make_store

LAYERS, KVH, HD = 2, 2, 8
BASE = [random.Random(5).randrange(2) for _ in range(160)]  # the common "system prompt"


def model_kv(ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V a model would compute: position p depends on the whole prefix ids[:p+1] (exact in fp16)."""
    r, vals = 0, []
    for p, tok in enumerate(ids):
        r = (r * 3 + tok + 1) % 16
        vals.append(r + p / 16)
    k = torch.tensor(vals).view(1, -1, 1).expand(KVH, -1, HD).half()  # [kv_heads, T, head_dim]
    return k, (layer - k).half()


class SharingMachine(RuleBasedStateMachine):
    @initialize(order=st.sampled_from(["compress-then-tier", "tier-then-compress"]),
                policy=st.sampled_from(["lru", "h2o"]))
    def setup(self, order, policy):
        self.dir = tempfile.mkdtemp(prefix="kvtier-share-sm-")
        self.store = make_store(Path(self.dir), num_layers=LAYERS, kv_heads=KVH, head_dim=HD, device_tokens=12,
                                host_bytes=4096, order=order, policy=policy, max_sequences=3,
                                fingerprint="sm-model")
        self.ids: dict[int, list[int]] = {}

    def teardown(self):
        if hasattr(self, "store"):
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _append(self, s: int, new: list[int]) -> None:
        old = self.ids[s]
        self.store.note_tokens(s, new)
        for layer in range(LAYERS):
            k, v = model_kv(old + new, layer)
            self.store.append(s, layer, k[:, len(old):], v[:, len(old):])
        old += new

    @precondition(lambda self: len(self.ids) < 3)
    @rule(n=st.integers(0, 60))
    def add(self, n):
        s = self.store.add_sequence()
        self.ids[s] = []
        got = self.store.attach_prefix(s, BASE[:n]) if n else 0
        assert got % 4 == 0 and got <= n
        self.ids[s] = BASE[:got]

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), n=st.sampled_from([1, 3, 4, 9]),
          follow=st.sampled_from([True, True, True, True, False]))
    def append(self, data, n, follow):
        s = data.draw(st.sampled_from(sorted(self.ids)))
        p = len(self.ids[s])
        if follow and self.ids[s] == BASE[:p] and p + n <= len(BASE):
            new = BASE[p:p + n]  # stays on the common prefix: blocks shared with others
        else:
            new = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        self._append(s, new)
        self.store.end_step()

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def read(self, data):
        s = data.draw(st.sampled_from(sorted(self.ids)))
        for layer in range(LAYERS):
            K, V = self.store.gather(s, layer)
            k, v = model_kv(self.ids[s], layer) if self.ids[s] else (K, V)
            assert torch.equal(K, k) and torch.equal(V, v), f"seq {s} layer {layer}"

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), keep=st.booleans())
    def drop(self, data, keep):
        s = data.draw(st.sampled_from(sorted(self.ids)))
        self.store.drop_sequence(s, keep_prefix=keep)
        del self.ids[s]

    @rule()
    def lookup(self):
        n = self.store.match_prefix(BASE)
        assert n % 4 == 0 and n <= len(BASE)

    @invariant()
    def consistent(self):
        if not hasattr(self, "store"):
            return
        store = self.store
        # reference counts (exactly the live entries holding each record), L3 holding the live
        # records plus unreferenced content records (kept by drops), one home per block
        store.check_invariants()
        if store.l3 is not None:
            # the unreferenced records left in L3 are this model's content records
            live3 = {k for k, r in store.residency.copies.items() if r.l3}
            extra = set(store.l3.keys()) - live3
            assert all(k.startswith(store.content_fp) for k in extra), extra
        for s, ids in self.ids.items():
            assert store.seq_len(s, 0) == len(ids) == store.tokens_noted(s)
        s = store.stats()
        assert s["copies"]["l2"] == len(store.l2)


SharingMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=50, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestSharingMachine = SharingMachine.TestCase
