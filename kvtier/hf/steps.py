"""The forward a TieredCache is in: begun at its layer-0 append, finished layer by layer, and the
store's step boundary (eviction, async swap-out, prefetch) run when its last layer finishes.

A forward that fails anywhere leaves no trace: :meth:`ForwardSteps.abort` crops every layer back
to where it started (or gives back the sequences it registered), when the model's forward hook
sees the exception, or at the latest when the next forward begins. How a layer finishes (at
``update``, or after kvtier's attention took its hand-over) is :mod:`.handover`'s.
"""
from __future__ import annotations

import torch

from kvtier.store import KVStore

from .handover import Step
from .prefix import TokenKeys
from .rows import BatchRows


class ForwardSteps:
    """The step in flight of one cache, and what finishing or rolling it back does.

    Args:
        layers: the cache's layers (their ``length`` is cut back on a roll-back).
        counters: the cache's counters, where steps count context, attended and rolled-back tokens.
    """

    def __init__(self, store: KVStore, rows: BatchRows, keys: TokenKeys, layers: list, counters: dict) -> None:
        self.store = store
        self.rows = rows
        self.keys = keys
        self.layers = layers
        self.counters = counters
        self.current: Step | None = None
        # per sparse layer call: (sequence, layer, selected blocks, attention mass), given to the
        # store's policy when the step finishes
        self.observed: list[tuple[int, int, list[int], torch.Tensor]] = []

    def begin(self, b: int, t: int) -> None:
        """A forward of batch ``b`` appending ``t`` tokens starts (its layer-0 update)."""
        prev = self.current
        if prev is not None and not prev.finished:
            self.abort()  # an earlier forward failed where no hook saw it
        registered = False
        rows = self.rows
        if not rows.seqs:
            if b < 1:
                raise ValueError(f"first update must have batch >= 1; got {b}")
            rows.register(b)  # all or none: a refused batch registers nothing
            registered = True
        elif b != len(rows):
            n = len(rows)
            hint = (f" (a filled cache is not expanded by generate(): for num_beams or num_return_sequences "
                    f"call cache.batch_repeat_interleave({b // n}) first)") if b % n == 0 else ""
            raise ValueError(f"batch size must stay {n} for this cache; got {b}{hint}")
        self.current = Step(start=self.layers[0].length, tokens=t, registered=registered)

    def layer_done(self, l: int, attended: int) -> None:
        """Layer ``l``'s attention has what it needs (``attended`` tokens); the last layer ends the step."""
        step = self.current
        step.done.add(l)
        if l == 0:
            self.counters["context_tokens"] += self.layers[0].length
        self.counters["attended_tokens"] += attended
        if l == len(self.layers) - 1:
            if self.observed:
                for seq, layer, sel, mass in self.observed:
                    self.store.observe(seq, layer, sel, mass)
                self.observed.clear()
            self.store.end_step()
            step.finished = True

    def abort(self) -> None:
        """Roll the forward in flight back: every layer as it was before it (no trace left)."""
        step, self.current = self.current, None
        self.observed.clear()
        self.keys.drop_pending()
        if step is None or self.store.closed:
            return
        self.counters["rolled_back_steps"] += 1
        if step.registered:
            self.rows.release()
            for layer in self.layers:
                layer.reset()
            self.keys.restart()
            return
        self.rows.truncate(step.start)
        for layer in self.layers:
            layer.length = min(layer.length, step.start)

    def ended(self, failed: bool) -> None:
        """The model's forward returned (``failed``: it raised): a step not finished is rolled back.

        Raises:
            RuntimeError: the forward returned with layers not finished (the model has other
                layers than the cache, or does not attend through kvtier's attention).
        """
        step = self.current
        if step is None:
            return
        if failed:
            self.abort()
            return
        self.current = None
        if not step.finished:
            self.current = step
            self.abort()
            n = len(self.layers)
            missing = sorted(set(range(n)) - step.done)
            raise RuntimeError(f"TieredCache: the forward returned with layers {missing[:8]} not finished "
                               f"(the step was rolled back); the model must have {n} "
                               f"layers and attend through attn_implementation='kvtier'")
