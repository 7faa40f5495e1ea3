"""Hypothesis state machine: the store against a plain dict of appended tokens, with every
policy and order, L1/L2 tiny enough that blocks keep moving down to L3."""
import shutil
import tempfile

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.store import SwapOutError

from .conftest import check_invariants, make_store

LAYERS = 2


class StoreMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "sink-window", "h2o", "snapkv"]),
                order=st.sampled_from(["compress-then-tier", "tier-then-compress"]),
                prefetch=st.booleans(), fail=st.booleans())
    def setup(self, policy, order, prefetch, fail):
        self.dir = tempfile.mkdtemp(prefix="kvtier-sm-")
        from pathlib import Path

        self.store = make_store(Path(self.dir), num_layers=LAYERS, device_tokens=12, budget_tokens=12,
                                sink_tokens=4, window_tokens=0, host_bytes=4096, policy=policy, order=order,
                                attention="sparse", prefetch=prefetch, max_sequences=3)
        self.ref: dict[int, list[list[torch.Tensor]]] = {}
        self.counter = 0
        # at most one injected swap-out failure per run (the first swap-out, or one after the
        # rule arms it): armed -> fired (a block held in L1) -> reported (or its sequence dropped)
        self.failure = "armed" if fail else None
        io, encode_pair = self.store.io, self.store.io.encode_pair

        def failing_encode_pair(block, tier, codec=None):
            if tier == "l2" and self.failure == "armed":
                self.failure = "fired"
                raise OSError("injected codec failure")
            return encode_pair(block, tier, codec)

        io.encode_pair = failing_encode_pair

    def teardown(self):
        if hasattr(self, "store"):
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _tokens(self, n):
        # distinct values per token so a misplaced token cannot go unnoticed
        base = torch.arange(self.counter, self.counter + n, dtype=torch.float32)
        self.counter += n
        k = (base[None, :, None] + torch.arange(8)[None, None, :] / 16 + torch.arange(2)[:, None, None] * 0.5)
        return k.half(), (-k).half()

    def _call(self, s, fn, *args):
        """``fn(*args)`` on sequence ``s``; a swap-out failure is raised once, by a call on its
        own sequence, before that call did anything: then the call is made again."""
        try:
            return fn(*args)
        except SwapOutError as e:
            assert self.failure == "fired" and e.seq == s, (self.failure, e)
            self.failure = "reported"
            return fn(*args)

    @precondition(lambda self: self.failure is None)
    @rule()
    def fail_next_swap_out(self):
        self.failure = "armed"

    @precondition(lambda self: len(self.ref) < 3)
    @rule()
    def add(self):
        self.ref[self.store.add_sequence()] = [[] for _ in range(LAYERS)]

    @precondition(lambda self: self.ref)
    @rule(data=st.data(), n=st.sampled_from([1, 1, 1, 3, 4, 9]))
    def append(self, data, n):
        s = data.draw(st.sampled_from(sorted(self.ref)))
        layer = data.draw(st.integers(0, LAYERS - 1))
        k, v = self._tokens(n)
        self._call(s, self.store.append, s, layer, k, v)
        self.ref[s][layer].append(k)

    @rule()
    def end_step(self):
        self.store.end_step()

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def sparse_read(self, data):
        s = data.draw(st.sampled_from(sorted(self.ref)))
        layer = data.draw(st.integers(0, LAYERS - 1))
        if not self.ref[s][layer]:
            return
        q = torch.randn(4, 1, 8)
        sel = self._call(s, self.store.select, s, layer, q)
        assert sel == sorted(set(sel)) and len(sel) <= 2
        K, V, pos = self._call(s, self.store.gather_blocks, s, layer, sel)
        ref = torch.cat(self.ref[s][layer], 1)
        assert torch.equal(K, ref[:, pos]) and torch.equal(V, -ref[:, pos])
        self._call(s, self.store.observe, s, layer, sel, torch.rand(len(sel) + 1))

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def view_read(self, data):
        """gather_view of any distinct sealed blocks, in any order: the rows are the tokens that
        ``pos`` names, and ``order`` names the block of every ``block_tokens`` rows."""
        s = data.draw(st.sampled_from(sorted(self.ref)))
        layer = data.draw(st.integers(0, LAYERS - 1))
        if not self.ref[s][layer]:
            return
        ns = -(-self.store.seq_len(s, layer) // 4) - 1
        blocks = data.draw(st.lists(st.integers(0, max(0, ns - 1)), max_size=2, unique=True)) if ns else []
        K, V, pos, order = self._call(s, self.store.gather_view, s, layer, blocks)
        assert sorted(order[:-1]) == sorted(blocks) and order[-1] == ns
        assert torch.equal(pos, (torch.tensor(order)[:, None] * 4 + torch.arange(4)).view(-1)[: pos.numel()])
        ref = torch.cat(self.ref[s][layer], 1)
        assert torch.equal(K, ref[:, pos]) and torch.equal(V, -ref[:, pos])
        self._call(s, self.store.observe, s, layer, order, torch.rand(len(order)))

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def dense_read(self, data):
        s = data.draw(st.sampled_from(sorted(self.ref)))
        layer = data.draw(st.integers(0, LAYERS - 1))
        K, V = self._call(s, self.store.gather, s, layer)
        ref = torch.cat(self.ref[s][layer], 1) if self.ref[s][layer] else K
        assert torch.equal(K, ref) and torch.equal(V, -ref)

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def drop(self, data):
        s = data.draw(st.sampled_from(sorted(self.ref)))
        self.store.drop_sequence(s)  # forgets a failure not yet reported, with its held block
        del self.ref[s]
        if self.failure == "fired" and not self.store.residency.failures:
            self.failure = "reported"  # it was s's

    @invariant()
    def consistent(self):
        if hasattr(self, "store"):
            check_invariants(self.store)
            errors = self.store.stats()["evictions"]["swap_out_errors"]
            assert errors == (self.failure in ("fired", "reported")), (errors, self.failure)
            for s, layers in self.ref.items():
                for layer, chunks in enumerate(layers):
                    assert self.store.seq_len(s, layer) == sum(c.shape[1] for c in chunks)


StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=50, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestStoreMachine = StoreMachine.TestCase
