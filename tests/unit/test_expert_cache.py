"""LRU residency and the q* split, against hand-worked expectations."""
import pytest

from tidal.experts.gpu_cache import LRUResidency
from tidal.experts.policy import num_fills


def test_lru_hit_refreshes_and_eviction_takes_least_recent():
    lru = LRUResidency(3)
    for key in [(0, 1), (0, 2), (1, 1)]:
        lru.admit(key)
    lru.touch((0, 1))                       # (0, 2) is now the least recently used
    slot, evicted = lru.admit((2, 5))
    assert evicted == (0, 2)
    assert (0, 2) not in lru and (2, 5) in lru
    assert slot not in {lru.slot((0, 1)), lru.slot((1, 1))}


def test_protected_entries_are_never_evicted():
    lru = LRUResidency(2)
    lru.admit((0, 0))
    lru.admit((0, 1))
    lru.protected = {(0, 0)}
    _, evicted = lru.admit((0, 2))
    assert evicted == (0, 1)
    lru.protected = {(0, 0), (0, 2)}
    with pytest.raises(RuntimeError):
        lru.admit((0, 3))


def test_slots_are_unique_and_reused():
    lru = LRUResidency(4)
    slots = {lru.admit((0, e))[0] for e in range(4)}
    assert slots == {0, 1, 2, 3}
    for e in range(4, 12):
        lru.admit((0, e))
        assert len({lru.slot(k) for k in lru.keys()}) == len(lru) == 4


def test_resize_keeps_most_recent():
    lru = LRUResidency(4)
    for e in range(4):
        lru.admit((0, e))
    lru.touch((0, 0))
    evicted = lru.resize(2)
    assert len(lru) == 2 and all(lru.slot(k) < 2 for k in lru.keys())
    assert set(evicted) | set(lru.keys()) == {(0, e) for e in range(4)}
    lru.resize(5)
    for e in range(10, 13):
        lru.admit((1, e))
    assert len(lru) == 5


@pytest.mark.parametrize("m", [1, 2, 5, 8, 33])
def test_qstar_edges(m):
    assert num_fills("qstar", m, 50.0, 50.5) == m            # B_H ~ B_P: fill everything
    assert num_fills("qstar", m, 1.0, 1000.0) == 1           # B_H >> B_P: still at least one fill
    assert num_fills("qstar", m, 55.0, 137.0) == max(1, min(m, round(m * 55 / 137)))
    assert num_fills("transfer", m, 1.0, 100.0) == m
    assert num_fills("cpu", m, 100.0, 100.0) == 0
    assert num_fills("qstar", 0, 50.0, 100.0) == 0
