"""Stop strings over streamed text.

The detokenizer hands us text deltas; a stop string can arrive split over several of them ("</fi" +
"nal>"). We therefore hold back the longest tail of the text that is still the beginning of some stop
string, and emit everything before it. When a stop string completes we emit the text before it and
report the hit; the stop string itself and anything after it are never emitted.

Cost per feed: O(len(delta) + held) per stop string, with held < the longest stop string.
"""
from __future__ import annotations


class StopStringMatcher:
    """Finds the first occurrence of any stop string in a stream of text deltas."""

    def __init__(self, stops: list[str] | tuple[str, ...] = ()) -> None:
        # "" would match everywhere; it is a no-op stop, not "stop immediately".
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None   # the stop string that was hit, if any

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit). After a hit, always ("", True)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        buf = self._held + delta
        # Earliest occurrence wins; among stops starting at the same place the longest is reported.
        first, hit = len(buf), None
        for stop in self.stops:
            i = buf.find(stop)
            if i != -1 and (i < first or (i == first and hit is not None and len(stop) > len(hit))):
                first, hit = i, stop
        if hit is not None:
            self.stopped, self.matched, self._held = True, hit, ""
            return buf[:first], True
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if stop.startswith(buf[-k:]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """At the end of generation without a hit: the held-back text (it was not a stop after all)."""
        if self.stopped:
            return ""
        held, self._held = self._held, ""
        return held

    @property
    def held(self) -> str:
        """Text currently held back (a possible beginning of a stop string)."""
        return self._held
