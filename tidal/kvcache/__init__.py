"""KV memory: a page pool for attention layers, a state pool for recurrent (linear-attention) layers."""
from tidal.kvcache.page_pool import KVPool, PageAllocator  # noqa: F401
from tidal.kvcache.state_pool import StatePool, StateSlotAllocator  # noqa: F401

__all__ = ["KVPool", "PageAllocator", "StatePool", "StateSlotAllocator"]
