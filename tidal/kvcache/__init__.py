"""KV memory: a page pool for attention layers."""
from tidal.kvcache.page_pool import KVPool, PageAllocator  # noqa: F401
