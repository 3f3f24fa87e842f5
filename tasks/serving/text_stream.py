"""Incremental detokenisation of one completion, with stop strings.

Stop strings: after each token the completion is decoded again (together with the last
prompt tokens, so a leading space survives); the first occurrence of any stop string ends
the request and the text is cut before it (OpenAI's semantics). A streamed delta never
contains a tail that could still become a stop string, nor an incomplete UTF-8 character
(byte-fallback pieces decode to U+FFFD until the character is complete).
"""

from __future__ import annotations

from collections.abc import Sequence

_HEAD_TOKENS = 8  # prompt tokens decoded with the completion, so its first piece keeps its leading space


class TextStream:
    """Incremental detokenisation of one completion with stop strings (see the module docstring)."""

    def __init__(self, sp, prompt_ids: Sequence[int], stop: Sequence[str], eos_id: int):
        self.sp, self.eos = sp, eos_id
        self.head = [int(t) for t in prompt_ids if t != eos_id][-_HEAD_TOKENS:]
        self.head_text = sp.decode(self.head) if self.head else ""
        self.stop = [s for s in stop if s]
        self.sent = 0  # characters of the completion already handed out
        self.text = ""

    def _decode(self, new_ids: Sequence[int]) -> str:
        new = [int(t) for t in new_ids if t != self.eos]
        if not self.head:
            return self.sp.decode(new)
        full = self.sp.decode(self.head + new)
        return full[len(self.head_text) :] if full.startswith(self.head_text) else self.sp.decode(new)

    def update(self, new_ids: Sequence[int], final: bool) -> tuple[str, bool]:
        """(text to hand out now, whether a stop string was hit). After a hit, `self.text` is the final text."""
        text = self._decode(new_ids)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text = text[: min(hits)]
            delta, self.sent = self.text[self.sent :], len(self.text)
            return delta, True
        self.text = text
        end = len(text)
        if not final:
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            while end - hold > self.sent and text[end - hold - 1] == "\ufffd":  # an incomplete character
                hold += 1
            end -= hold
        if end <= self.sent:
            return "", False
        delta, self.sent = text[self.sent : end], end
        return delta, False
