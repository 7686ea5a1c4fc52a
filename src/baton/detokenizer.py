"""Streaming detokenization: generated ids -> text deltas that are safe to stream.

One ``IncrementalDetokenizer`` per running sequence, fed by the engine's output path. It only
calls ``Tokenizer.decode``; see ``tokenizer.py`` for the tokenizer itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded in front of the first generated ones, so decoders whose output for a
# token depends on its left neighbour (SentencePiece's leading "▁", WordPiece's "##") see it.
_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so a context window never has to grow by more than
# this to start on a character boundary.
_MAX_CONTEXT_EXTENSION = 4
# Tokens held back without the text ever reaching a clean end. Real text settles within a
# few tokens; past this the model is emitting invalid bytes (or only skipped special
# tokens) and we emit what we have, to keep each step's decode bounded.
_MAX_PENDING_TOKENS = 64


class IncrementalDetokenizer:
    """Streams one sequence's generated ids as text deltas.

    The window technique (as in vLLM and tokenizers' DecodeStream): keep a token window
    ``[prefix, ...)`` whose first part ``[prefix, read)`` is already emitted as
    ``prefix_text``. Each step decodes the window and emits what lies beyond
    ``prefix_text`` and was not emitted yet, holding back a trailing run of U+FFFD: that is
    what a character whose UTF-8 bytes are split across tokens decodes to until its last
    byte arrives. When the window
    decodes with a clean end, it slides forward, so a step costs O(window), not O(sequence).

    The concatenation of all deltas plus ``flush()`` equals ``tokenizer.decode`` of the
    generated ids (given a prompt, the decode of prompt + generated minus the prompt's text:
    the same thing for byte-level BPE; for SentencePiece it keeps the leading space).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = self._left_context(prompt_token_ids or ())
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = self._decode(context)
        self._emitted_past_prefix = 0  # chars beyond prefix_text already emitted
        self._chunks: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """All generated ids fed so far (no prompt ids)."""
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        return "".join(self._chunks)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they complete (possibly "")."""
        if not new_token_ids:
            return ""
        # Counted before this step's ids, so one large step (a speculative burst) is never
        # forced out mid-character.
        overflow = len(self._ids) - self._read > _MAX_PENDING_TOKENS
        self._ids.extend(new_token_ids)
        return self._advance(force=overflow)

    def flush(self) -> str:
        """At the end of generation: emit any held-back text, U+FFFD included."""
        return self._advance(force=True)

    def _advance(self, force: bool) -> str:
        text = self._decode(self._ids[self._prefix :])
        # Decoding is stable under appending at a clean boundary, so the window's text still
        # starts with prefix_text and everything beyond it is new.
        tail = text[len(self._prefix_text) :]
        held = 0 if force else len(tail) - len(tail.rstrip(REPLACEMENT_CHAR))
        emit_end = len(tail) - held
        delta = tail[self._emitted_past_prefix : emit_end]
        self._emitted_past_prefix = max(self._emitted_past_prefix, emit_end)
        # Slide only on growth: a step that added no text (a skipped special token) keeps the
        # old context, so the next token is still decoded with its left neighbour.
        if force or (held == 0 and tail):
            self._slide_window()
        elif held and emit_end:
            self._slide_to_clean_end(tail[:emit_end])
        if delta:
            self._chunks.append(delta)
        return delta

    def _slide_to_clean_end(self, emitted_tail: str) -> None:
        """The window ends mid-character: slide it to the last clean boundary among the
        final few tokens, so that a long run of split characters (byte-fallback tokens fed
        in steps that never end on a character) cannot grow it past _MAX_PENDING_TOKENS."""
        for k in range(1, _MAX_CONTEXT_EXTENSION + 1):
            end = len(self._ids) - k
            if end <= self._read:
                return
            if self._decode(self._ids[self._prefix : end]) == self._prefix_text + emitted_tail:
                self._prefix, self._read = self._read, end
                self._prefix_text = self._decode(self._ids[self._prefix : self._read])
                self._emitted_past_prefix = 0  # all text of ids[:end] is out
                return

    def _slide_window(self) -> None:
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        self._emitted_past_prefix = 0

    def _left_context(self, prompt_ids: Sequence[int]) -> list[int]:
        if not prompt_ids:
            return []
        start = max(len(prompt_ids) - _CONTEXT_TOKENS, 0)
        floor = max(start - _MAX_CONTEXT_EXTENSION, 0)
        # Start the context on a character boundary: a window that starts mid-character
        # decodes differently once more bytes follow (byte-fallback runs).
        while start > floor and self._decode(prompt_ids[start:]).startswith(REPLACEMENT_CHAR):
            start -= 1
        context = list(prompt_ids[start:])
        text = self._decode(context)
        starts_mid_char = start > 0 and text.startswith(REPLACEMENT_CHAR)
        # A prompt that ends mid-character would be completed by generated bytes; the
        # context would then swallow them, so generated text is decoded on its own instead.
        if starts_mid_char or text.endswith(REPLACEMENT_CHAR):
            return []
        return context

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class NullDetokenizer:
    """Detokenizer stand-in for models served without a tokenizer."""

    text = ""

    def step(self, token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""
