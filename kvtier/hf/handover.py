"""What one layer's ``cache.update`` hands to kvtier's attention function, and the step in flight.

transformers calls ``cache.update(k, v, layer, kwargs=attn_kwargs)`` and then the attention
function with ``**attn_kwargs`` -- the same dict. A :class:`TieredCache` layer that needs kvtier's
attention for this call puts a :class:`Handover` into that dict; the attention function takes it
out with the query. Nothing is kept per thread or per process, so a hand-over can only reach the
attention call of the very layer that made it: another cache, another model or a later forward
never sees it, and a forward that raises simply drops its dict.

```
 LlamaAttention.forward(hidden, ..., **kw)
   k, v = cache.update(k, v, l, kwargs=kw)   ──► kw["kvtier_handover"] = Handover(l, kind, k)
   attention(q, k, v, mask, **kw)            ──► claim(l, k) -> kind ... finish()
```
The cache tracks the forward itself as a :class:`Step`: the tokens before it and the layers that
finished. A step that does not finish (an exception anywhere in the forward, or a layer whose
hand-over was never claimed) is rolled back by the cache -- every layer cropped to where the step
started -- when the model's forward hook sees it fail, or at the latest when the next step starts.
"""
from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field

import torch

#: The attention kwarg a hand-over travels in (popped before any other attention sees the kwargs).
HANDOVER_KWARG = "kvtier_handover"


class StepKind(enum.Enum):
    """What kvtier's attention does with a layer's call."""

    SPARSE = "sparse"  # sparse mode, one-token decode: update returned only the new token;
                       # attention selects blocks with the query, reads them from L1, attends
    DENSE = "dense"    # sparse mode, multi-token step: attend everything update returned, then
                       # seed H2O/SnapKV from the last queries
    SPLIT = "split"    # a multi-token step over cached tokens: two unmasked passes merged by
                       # log-sum-exp may replace one SDPA over an explicit mask (exact causal only)


@dataclass(eq=False)
class Handover:
    """One layer's update -> attention hand-over.

    ``key`` is the K tensor ``update`` returned: the attention call is recognised by receiving
    exactly that tensor for ``layer``, so a stray hand-over can never be applied to another call.
    """

    cache: object                      # the TieredCache (strong: the dict lives one layer call)
    layer: int
    kind: StepKind
    key: weakref.ref
    claimed: bool = False

    def claim(self, layer_idx: int | None, key: torch.Tensor) -> StepKind | None:
        """The kind of this call if it is the one the hand-over was made for, else None."""
        if self.claimed or layer_idx != self.layer or self.key() is not key:
            return None
        self.claimed = True
        return self.kind


@dataclass(eq=False)
class Step:
    """The forward a TieredCache is in: its first layer appended, its last not yet finished."""

    start: int                          # tokens every layer held before this forward
    tokens: int                         # tokens this forward appends
    registered: bool                    # the forward registered the batch's sequences
    done: set[int] = field(default_factory=set)  # layers whose attention has what it needs
    handover: Handover | None = None    # the last one made, until claimed
    finished: bool = False              # the last layer finished: the step boundary ran

    def unclaimed(self) -> Handover | None:
        """A hand-over made for an attention call that never took it (the model does not attend
        through kvtier's attention), or None."""
        h = self.handover
        return h if h is not None and not h.claimed else None
