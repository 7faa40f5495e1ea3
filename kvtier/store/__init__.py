"""The store: block tables, eviction, async swap, prefetch and stats over the tiers.

See docs/architecture.md ("Store contract") for the contract with the integrations. Orchestration only: codecs live in
``kvtier.compress``, byte stores in ``kvtier.tiers``.
"""
from .keys import block_key
from .policy import POLICIES, EvictionPolicy, make_policy
from .store import KVStore
from .swap import SwapOutError

__all__ = ["KVStore", "SwapOutError", "block_key", "EvictionPolicy", "POLICIES", "make_policy"]
