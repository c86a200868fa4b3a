"""Replay routing traces (from `tidal trace`) against expert-cache placement policies.

Policies, each with a cache of C slots over (layer, expert):
  lru         global LRU over all layers: every miss is admitted, the least recently used leaves
              (Tidal's cache; the q* split changes how misses are served, not what the LRU keeps);
  prefill     KTransformers-style: after each prefill, the C experts that prefill used most are
              resident until the next prefill; decode never changes placement;
  static      llama.cpp-style (--n-cpu-moe): whole layers resident, fixed at load (the last
              layers, as many as fit), never changed.
Miss rate = decode-time expert reads that were not resident / all decode-time expert reads.

    python benchmarks/cache_replay.py TRACE.jsonl [...] --fractions 0.1,0.25,0.5
"""
from __future__ import annotations

import argparse
import json
from collections import Counter, OrderedDict
from pathlib import Path


def load(paths: list[str]) -> list[dict]:
    steps = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            rec = json.loads(line)
            if "layers" in rec:
                steps.append(rec)
    return steps


def shape(steps: list[dict]) -> tuple[list[int], int]:
    layers = sorted({int(k) for s in steps for k in s["layers"]})
    experts = 1 + max(e for s in steps for v in s["layers"].values() for tok in v for e in tok)
    return layers, experts


def reads(step: dict) -> list[tuple[int, int]]:
    """Distinct (layer, expert) reads of one forward, in layer order."""
    out = []
    for layer in sorted(step["layers"], key=int):
        seen = sorted({e for tok in step["layers"][layer] for e in tok})
        out.extend((int(layer), e) for e in seen)
    return out


def replay_lru(steps: list[dict], capacity: int) -> tuple[int, int]:
    cache: OrderedDict = OrderedDict()
    miss = total = 0
    for step in steps:
        decode = step["phase"] == "decode"
        for key in reads(step):
            if key in cache:
                cache.move_to_end(key)
            else:
                miss += decode
                cache[key] = True
                if len(cache) > capacity:
                    cache.popitem(last=False)
            total += decode
    return miss, total


def replay_qstar(steps: list[dict], capacity: int, fraction: float) -> tuple[int, int]:
    """Tidal's decode path: per layer, hits refresh the LRU and only q = clamp(round(m * q*/m), 1, m)
    of the m misses are filled (the rest run on the CPU and leave residency unchanged); prefill
    forwards fill every miss."""
    cache: OrderedDict = OrderedDict()
    miss = total = 0
    for step in steps:
        decode = step["phase"] == "decode"
        by_layer: dict[int, list] = {}
        for key in reads(step):
            by_layer.setdefault(key[0], []).append(key)
        for keys in by_layer.values():
            misses = [k for k in keys if k not in cache]
            for k in keys:
                if k in cache:
                    cache.move_to_end(k)
            q = len(misses) if not decode else (max(1, min(len(misses), round(len(misses) * fraction)))
                                                if misses else 0)
            for k in misses[:q]:
                cache[k] = True
                if len(cache) > capacity:
                    cache.popitem(last=False)
            if decode:
                miss += len(misses)
                total += len(keys)
    return miss, total


def replay_prefill(steps: list[dict], capacity: int) -> tuple[int, int]:
    resident: set = set()
    miss = total = 0
    for step in steps:
        if step["phase"] == "prefill":
            counts = Counter((int(l), e) for l, toks in step["layers"].items() for tok in toks for e in tok)
            resident = {k for k, _ in counts.most_common(capacity)}
            continue
        for key in reads(step):
            miss += key not in resident
            total += 1
    return miss, total


def replay_static(steps: list[dict], capacity: int, layers: list[int], experts: int) -> tuple[int, int]:
    n_layers = min(len(layers), capacity // experts)
    resident_layers = set(layers[len(layers) - n_layers:])
    miss = total = 0
    for step in steps:
        if step["phase"] != "decode":
            continue
        for layer, _ in reads(step):
            miss += layer not in resident_layers
            total += 1
    return miss, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--fractions", default="0.1,0.25,0.5", help="cache sizes as fractions of the expert pool")
    ap.add_argument("--qstar", type=float, default=0.46,
                    help="q*/m for the Tidal column (0.46: measured on the GPU machine by `tidal profile`)")
    args = ap.parse_args()
    steps = load(args.traces)
    layers, experts = shape(steps)
    pool = len(layers) * experts
    n_decode = sum(s["phase"] == "decode" for s in steps)
    print(f"traces: {', '.join(args.traces)}; {len(steps)} forwards ({n_decode} decode), "
          f"{len(layers)} MoE layers x {experts} experts = {pool} experts\n")
    print(f"| cache size | slots | global LRU, every miss filled | Tidal: global LRU, q*/m={args.qstar} fills | "
          "prefill-updated (KTransformers) | static (llama.cpp) |")
    print("|---|---|---|---|---|---|")
    for f in (float(x) for x in args.fractions.split(",")):
        c = max(1, int(f * pool))
        rates = [m / max(1, t) for m, t in (replay_lru(steps, c), replay_qstar(steps, c, args.qstar),
                                             replay_prefill(steps, c),
                                             replay_static(steps, c, layers, experts))]
        print(f"| {100 * f:.0f}% | {c} | " + " | ".join(f"{100 * r:.1f}% miss" for r in rates) + " |")


if __name__ == "__main__":
    main()
