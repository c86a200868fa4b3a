"""Radix prefix cache over KV pages: reuse, reference counts, LRU eviction."""
from tidal.kvcache.page_pool import PageAllocator
from tidal.scheduler.prefix_cache import PrefixCache


def test_match_returns_longest_full_page_prefix_and_leaves_a_token():
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, page_size=4)
    ids = list(range(100, 111))                 # 11 tokens: two full pages + 3
    pages = alloc.allocate(3)
    cache.insert(ids, pages)                    # only the two full pages enter the tree
    assert cache.num_pages == 2
    assert cache.match(ids + [7, 8]) == pages[:2]
    assert cache.match(ids[:8]) == pages[:1]    # 8 tokens: keep the last one to compute
    assert cache.match([1, 2, 3, 4, 5]) == []
    assert cache.match(ids[:4] + [0, 0, 0, 0, 9]) == pages[:1]


def test_refcounts_and_eviction_order():
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, page_size=2)
    a, b = alloc.allocate(2), alloc.allocate(2)
    cache.insert([1, 2, 3, 4], a)
    cache.insert([5, 6, 7, 8], b)
    alloc.release(a)
    alloc.release(b)                             # requests finished: only the tree holds them
    assert alloc.num_free == 4 and cache.evictable() == 4
    held = cache.match([1, 2, 3, 4, 9])          # a new request reuses both of a's pages
    assert held == a and alloc.refcount(a[0]) == 2
    assert cache.evictable() == 2
    assert cache.evict(10) == 2                  # only b's pages can go while a's are held
    assert alloc.num_free == 6 and cache.num_pages == 2
    alloc.release(held)
    assert cache.evict(10) == 2 and alloc.num_free == 8 and cache.num_pages == 0


def test_evictable_counts_whole_unreferenced_chains():
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, page_size=1)
    pages = alloc.allocate(4)
    cache.insert([1, 2, 3, 4], pages)
    alloc.release(pages)
    assert cache.evictable() == 4          # a chain of 4 nodes frees completely, leaf by leaf
    held = cache.match([1, 2, 9])          # a request holds the first two pages
    assert cache.evictable() == 2
    assert cache.evict(4) == 2 and alloc.num_free == 6
    alloc.release(held)
