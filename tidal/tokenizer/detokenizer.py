"""Token ids -> text, one token at a time, for streaming.

Decoding each token alone is wrong twice over: a byte-level token can carry half of a UTF-8 character
(decoding it gives U+FFFD), and SentencePiece-style decoders drop the word-boundary space of whatever
token comes first in the decoded list. So we keep a short window of ids and emit differences:

    ids:  ... | prefix window | pending (not yet emitted) |
              ^prefix         ^read                      ^end
    delta = decode(ids[prefix:end])[len(decode(ids[prefix:read])):]

The prefix window is text we already emitted, decoded again only so that the first pending token is
decoded "in context". While the decode ends in U+FFFD the last character is incomplete and we wait for
more tokens. After an emission the pending tokens become the new prefix window, so each step decodes a
few tokens: O(1) amortised per token, never the whole sequence.

Contract (the tests check it, for byte-level BPE, byte-fallback BPE and Unigram/Metaspace tokenizers):
- without prompt_ids, "".join(deltas) == tokenizer.decode(generated, skip_special_tokens) whenever that
  decode is well-formed UTF-8;
- with prompt_ids, the last few prompt tokens are the initial context, and the text is the generated
  part as it reads appended to the prompt: decode(prompt + generated) minus decode(prompt). For
  byte-level tokenizers that is the same string; SentencePiece-style tokenizers keep the space that
  separates the first generated word from the prompt (transformers' decode(generated) drops it);
- no delta ever ends inside a UTF-8 character (we hold back while the decode ends in U+FFFD, up to
  MAX_PENDING tokens: after that the bytes are invalid for good and are emitted as U+FFFD).
"""
from __future__ import annotations

from tidal.tokenizer.tokenizer import CLEANUP_REPLACEMENTS, Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context for the first generated token.
CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes and every byte-carrying token carries at least one; past this
# many pending tokens a trailing U+FFFD is permanent, so stop waiting (bounds the window).
MAX_PENDING = 8
# A window of tokens that add no text may grow to this many before we move past it anyway.
MAX_WINDOW = 4 * MAX_PENDING
# Ids before the window are dropped from memory once this many have accumulated.
_TRIM_AT = 4096


class IncrementalDetokenizer:
    """Streams the text of generated tokens. push() each id, flush() once at the end."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = self._pick_context([int(i) for i in (prompt_ids or [])[-CONTEXT_TOKENS:]])
        self._ids: list[int] = context
        self._prefix = 0                  # start of the decoded window
        self._read = len(context)         # ids before this are already emitted (or context)
        self._prefix_text = self._decode(context)   # decode(ids[prefix:read]), cached
        self._parts: list[str] = []
        self._text: str | None = ""
        self._cleanup = _CleanupStream() if tokenizer.clean_up_tokenization_spaces else None
        self._finished = False

    def _pick_context(self, tail: list[int]) -> list[int]:
        """The longest suffix of the prompt's tail that decodes cleanly.

        A window that starts inside a character decodes to U+FFFD (ByteFallback even turns the whole
        run of byte tokens into U+FFFDs), so we drop tokens from the left until it does not. If even
        the last token alone does not decode cleanly, the prompt ends mid-character and we use no
        context: the generated ids are then decoded on their own, as decode(generated) would.
        """
        for start in range(len(tail)):
            if REPLACEMENT_CHAR not in self._decode(tail[start:]):
                return tail[start:]
        return []

    def _decode(self, ids: list[int]) -> str:
        # Raw decode: clean_up_tokenization_spaces (if any) is applied as a stream in _emit.
        return self._tokenizer.decode_raw(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that is now final (often "", never a partial char)."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.push() after flush()")
        token_id = int(token_id)
        if self._skip and token_id in self._tokenizer.skipped_ids:
            return ""                      # decode drops it before decoding: it cannot change any text
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix:])
        pending = len(self._ids) - self._read
        if new_text.endswith(REPLACEMENT_CHAR) and pending < MAX_PENDING:
            return ""                      # last character incomplete: wait for its other bytes
        if new_text == self._prefix_text and len(self._ids) - self._prefix < MAX_WINDOW:
            # The token added no text here (e.g. a lone "▁" that the decoder strips at the start).
            # Count it as read but keep the prefix window, so the next token is still decoded in
            # the same context (the stripped space then reappears before it).
            self._read = len(self._ids)
            return ""
        # If the decoder rewrote text we already emitted (ByteFallback turns a whole run of byte tokens
        # into U+FFFDs once the run becomes invalid UTF-8), that text is out already; the full decode
        # then contains U+FFFD, which is outside the contract, so we simply continue after it.
        delta = new_text[len(self._prefix_text):]
        self._advance()
        return self._emit(delta)

    def _advance(self) -> None:
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        if self._prefix >= _TRIM_AT:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character becomes U+FFFD, as decode() does)."""
        if self._finished:
            return ""
        delta = ""
        if self._read < len(self._ids):
            new_text = self._decode(self._ids[self._prefix:])
            delta = new_text[len(self._prefix_text):]
            self._read = len(self._ids)
        out = self._emit(delta)
        if self._cleanup is not None:
            tail = self._cleanup.flush()
            if tail:
                self._parts.append(tail)
                self._text = None
            out += tail
        self._finished = True
        return out

    def _emit(self, delta: str) -> str:
        if self._cleanup is not None:
            delta = self._cleanup.feed(delta)
        if delta:
            self._parts.append(delta)
            self._text = None
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text is None:
            self._text = "".join(self._parts)
            self._parts = [self._text]
        return self._text


class _StreamReplace:
    """str.replace(old, new) over a stream: holds back a tail that could still start `old`."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new, self.buf = old, new, ""

    def feed(self, text: str) -> str:
        buf = self.buf + text
        out, i = [], 0
        while (j := buf.find(self.old, i)) >= 0:   # leftmost non-overlapping, like str.replace
            out += (buf[i:j], self.new)
            i = j + len(self.old)
        rest = buf[i:]
        keep = next((k for k in range(min(len(rest), len(self.old) - 1), 0, -1)
                     if self.old.startswith(rest[-k:])), 0)
        self.buf = rest[len(rest) - keep:]
        out.append(rest[:len(rest) - keep])
        return "".join(out)

    def flush(self) -> str:
        buf, self.buf = self.buf, ""
        return buf


class _CleanupStream:
    """transformers' clean_up_tokenization as a chain of streaming replacements (same order), so the
    streamed text equals decode() on tokenizers that enable it."""

    def __init__(self) -> None:
        self._stages = [_StreamReplace(old, new) for old, new in CLEANUP_REPLACEMENTS]

    def feed(self, text: str) -> str:
        for stage in self._stages:
            text = stage.feed(text)
        return text

    def flush(self) -> str:
        carry = ""
        for stage in self._stages:
            carry = stage.feed(carry) + stage.flush()
        return carry
