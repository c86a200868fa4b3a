"""How many of a layer's misses to fill (copy to the cache) versus run on the CPU.

DESIGN.md "Why q*": filling q misses costs ~q*S/B_P, the CPU branch ~(m-q)*S/(B_H-B_P) since both
read the same DRAM; balancing the two gives q* = m*B_P/B_H. The split decides *how many*; the LRU
decides *which slots* they take.
"""
from __future__ import annotations

POLICIES = ("qstar", "transfer", "cpu", "static")


def num_fills(policy: str, m: int, b_p: float, b_h: float) -> int:
    """Number of the m misses to fill under `policy` (bandwidths in any common unit)."""
    if m <= 0:
        return 0
    if policy == "transfer":
        return m
    if policy in ("cpu", "static"):
        return 0
    if policy == "qstar":
        if b_h <= 0:
            return m
        return max(1, min(m, round(m * b_p / b_h)))
    raise ValueError(f"unknown policy {policy!r}")
